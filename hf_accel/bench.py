"""``hf-accel bench``: a technique-comparison table on the user's model, every figure measured in one run.

Each technique patches the same model instance, runs warm-up then ``repeats`` timed ``generate`` calls per
batch size, and is unpatched again (``unpatch_model`` restores the model exactly). The baseline is the model
with only hf_accel's ``generate`` instrumentation (no feature), so every row is measured the same way
(:class:`~hf_accel.core.metrics.GenerationStats`). Greedy outputs are compared with the baseline's; lossy
techniques also report the perplexity change on a fixed English text.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .core.config import AccelConfig, Int8Config
from .core.errors import IncompatibleOptionsError
from .core.metrics import GenerationStats
from .patch import last_stats, patch_model, patch_report, unpatch_model

__all__ = ["TECHNIQUES", "BenchResult", "parse_techniques", "run_bench"]

logger = logging.getLogger("hf_accel")
LICENSE = Path("/usr/share/common-licenses/GPL-3")  # real English text shipped with Debian

CHAT_PROMPTS = [  # long free-form answers first: batch 1 measures a whole answer, not a one-liner
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works.",
    "List five facts about the Moon.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "What is the capital of France? Answer in one sentence.",
]


@dataclass(frozen=True)
class Technique:
    """One row family of the table.

    Args:
        name: the ``--techniques`` name.
        patch: the features on (``patch_model`` keywords over an empty ``AccelConfig``); ``None``: the default patch
            (``patch_model(model)``).
        generate: ``generate`` keywords.
        lossless: greedy output must equal the baseline's.
        unavailable: why the technique cannot run in this version/device (``None`` = it can).
        gain: where its speed-up comes from (speculative rows add what each call's stats measured).
    """

    name: str
    patch: dict[str, Any] | None
    generate: dict[str, Any] = field(default_factory=dict)
    lossless: bool = True
    unavailable: Callable[[], str | None] = lambda: None
    gain: str = ""


def _self_spec() -> dict[str, Any]:
    from .speculative import SelfSpeculative

    return {"speculative": SelfSpeculative("int8")}


def _missing(load: Callable[[], object]) -> str | None:
    """Why an optional backend cannot run here (``load()`` raised ``FeatureNotAvailableError``), or ``None``."""
    from .core.errors import FeatureNotAvailableError

    try:
        load()
    except FeatureNotAvailableError as exc:
        return str(exc)
    return None


def _no_quanto() -> str | None:
    from .quant.quanto import quanto_module

    return _missing(quanto_module)


def _no_bnb() -> str | None:
    from .quant.bnb import bnb_module

    return _missing(bnb_module)


_SPEC = "speculation"  # the gain of speculative rows is described from their stats (_speculative_gain)
TECHNIQUES: dict[str, Technique] = {
    t.name: t
    for t in (
        Technique("baseline", {}, gain="-"),
        Technique("default", None, gain=_SPEC),  # what patch_model(model) turns on for this model and device
        Technique("fused", {"fused_mlp": True}, gain="one gate+up matmul per MLP"),
        Technique("paged", {"paged": True}, {"paged": True}, gain="paged KV (no padding) + paged attention"),
        Technique("compile", {"fused_mlp": True, "compile": True}, gain="pre-packed linears + compiled decode step"),
        Technique("native", {"fused_mlp": True, "native": True}, gain="native executor (a step in one C++ call)"),
        Technique("int8", {"int8": Int8Config(keep_original=True)}, lossless=False, gain="int8 weights (lossy)"),
        Technique(
            "w8a8",
            {"int8": Int8Config(activations="int8", keep_original=True)},
            lossless=False,
            gain="int8 weights and activations (lossy)",
        ),
        Technique(
            "bnb",
            {"int8": Int8Config(backend="bitsandbytes", keep_original=True)},
            lossless=False,
            unavailable=_no_bnb,
            gain="bitsandbytes int8 weights (lossy)",
        ),
        Technique(
            "quanto",
            {"int8": Int8Config(backend="quanto", keep_original=True)},
            lossless=False,
            unavailable=_no_quanto,
            gain="optimum-quanto int8 weights (lossy)",
        ),
        Technique("prompt-lookup", {"speculative": True}, {"prompt_lookup": True}, gain=_SPEC),
        Technique("draft", {"speculative": True}, gain=_SPEC),  # needs --draft-model
        Technique("self-spec", {"speculative": True}, {"self_spec": True}, gain=_SPEC),
        Technique("self-spec+native", {"speculative": True, "native": True}, {"self_spec": True}, gain=_SPEC),
        Technique("all", {}),
    )
}


def _speculative_gain(spec: dict[str, Any]) -> str:
    """What a speculative row's speed-up comes from: tokens per target forward (speculation's own share: 1.00 is
    none) and what ran the target's forwards (often the native executor, a gain of its own)."""
    per_forward = spec.get("tokens_per_forward", 0.0)
    own = "none from speculation" if per_forward < 1.05 else f"speculation x{per_forward:.2f}"
    return f"{own} ({per_forward:.2f} tokens/forward); target: {spec.get('target') or 'model forward'}"


def parse_techniques(text: str, has_draft: bool) -> tuple[list[Technique], list[str]]:
    """Technique names -> (techniques to run, notes on those skipped by ``all``).

    Raises:
        IncompatibleOptionsError: an unknown name, or a technique named explicitly that cannot run here.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TECHNIQUES]
    if unknown or not names:
        raise IncompatibleOptionsError(
            f"unknown technique(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TECHNIQUES)}"
        )
    expand = "all" in names
    chosen = [t for t in TECHNIQUES.values() if t.name != "all" and (expand or t.name in names)]
    if chosen[0].name != "baseline":
        chosen.insert(0, TECHNIQUES["baseline"])
    run, notes = [], []
    for t in chosen:
        why = t.unavailable() or (None if t.name != "draft" or has_draft else "needs --draft-model PATH")
        if why is None:
            run.append(t)
        elif expand and t.name not in names:
            notes.append(f"{t.name}: skipped ({why})")
        else:
            raise IncompatibleOptionsError(f"technique {t.name!r} cannot run here: {why}")
    return run, notes


def load_prompts(spec: str, tokenizer: Any, count: int) -> list[str]:
    """``chat`` | ``grounded`` | a ``.jsonl`` file of ``{"prompt": ...}`` lines -> ``count`` chat-formatted texts."""
    if spec == "chat":
        users = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(count)]
    elif spec == "grounded":
        text = LICENSE.read_text() if LICENSE.exists() else " ".join(CHAT_PROMPTS * 40)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        passages = [tokenizer.decode(ids[2000 + 300 * i : 2300 + 300 * i]) for i in range(count)]
        users = [
            f"Fix the punctuation of the following passage and write it out again in full:\n\n{p}" for p in passages
        ]
    else:
        path = Path(spec)
        if not path.is_file():
            raise IncompatibleOptionsError(f"--prompts takes chat, grounded or a .jsonl file; {spec!r} is neither")
        users = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    users.append(str(json.loads(line)["prompt"]))
                except (ValueError, KeyError, TypeError) as err:
                    raise IncompatibleOptionsError(f'{path}:{number}: expected {{"prompt": "..."}}: {err}') from None
        if not users:
            raise IncompatibleOptionsError(f"{path} holds no prompts")
        users = [users[i % len(users)] for i in range(count)]
    if getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=False)
            for u in users
        ]
    return users


def perplexity(model: nn.Module, tokenizer: Any, tokens: int = 512) -> float:
    """Perplexity of ``model`` over the first ``tokens`` tokens of a fixed English text."""
    text = LICENSE.read_text() if LICENSE.exists() else " ".join(CHAT_PROMPTS * 40)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :tokens].to(next(model.parameters()).device)
    with torch.inference_mode():
        loss = model(input_ids=ids, labels=ids).loss
    return math.exp(float(loss))


@dataclass
class BenchResult:
    """One table row: a technique at one batch size (medians over repeats)."""

    technique: str
    batch: int
    ttft_ms: float
    tpot_ms: float
    decode_tok_s: float
    e2e_tok_s: float
    speedup: float = 1.0
    kv_mib: float | None = None
    peak_rss_mib: float | None = None
    identical: str = "-"
    ppl_delta_pct: float | None = None
    acceptance: float | None = None
    spread_pct: float | None = None  # None: one timed run (no spread to measure)
    gain_from: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _median_stats(samples: list[GenerationStats]) -> dict[str, float | None]:
    rates = [s.decode_tokens_per_s for s in samples]
    med = statistics.median(rates)
    spread = (max(rates) - min(rates)) / med * 100 if med and len(rates) > 1 else None
    return {
        "ttft_ms": statistics.median(s.ttft_s for s in samples) * 1000,
        "tpot_ms": statistics.median(s.tpot_mean_s for s in samples) * 1000,
        "decode_tok_s": med,
        "e2e_tok_s": statistics.median(s.end_to_end_tokens_per_s for s in samples),
        "spread_pct": spread,
    }


def _measure(
    model: nn.Module, tech: Technique, batch: int, inputs: dict[str, torch.Tensor], kwargs: dict[str, Any],
    repeats: int, bar: Any,
) -> tuple[BenchResult, torch.Tensor]:  # fmt: skip
    """One warm-up (it compiles) and ``repeats`` timed calls of one technique at one batch size: the row (without
    the baseline comparison) and the last output."""
    with torch.inference_mode():
        model.generate(**inputs, **{**kwargs, "max_new_tokens": 4})
        bar.update()
        bar.set_postfix_str(f"{tech.name} batch {batch}")
        samples, out = [], None
        for _ in range(repeats):
            if torch.cuda.is_available() and inputs["input_ids"].is_cuda:  # this CLI's own process: per-call peaks
                torch.cuda.reset_peak_memory_stats(inputs["input_ids"].device)
            out = model.generate(**inputs, **kwargs).sequences
            samples.append(last_stats(model))
            bar.update()
    row = BenchResult(tech.name, batch, **_median_stats(samples))
    last = samples[-1]
    row.kv_mib = last.kv_bytes_used / 2**20 if last.kv_bytes_used is not None else None
    row.peak_rss_mib = last.peak_memory_bytes / 2**20 if last.peak_memory_bytes else None
    row.acceptance = last.speculative["acceptance_rate"] if last.speculative else None
    row.gain_from = _speculative_gain(last.speculative) if tech.gain == _SPEC and last.speculative else tech.gain
    if tech.patch is None:  # the default patch: what it chose here, then where the speed came from
        uses = patch_report(model)["implementations"].get("default", {}).get("configuration", {}).get("uses", "")
        row.gain_from = f"{uses}; {row.gain_from}" if last.speculative else uses
    return row, out


def _patch(model: nn.Module, tech: Technique) -> None:
    """Patch ``model`` as ``tech`` says: exactly its features, or the default patch."""
    if tech.patch is None:
        patch_model(model)
    else:
        patch_model(model, AccelConfig(), **tech.patch)


def run_bench(
    model: nn.Module,
    tokenizer: Any,
    techniques: list[Technique],
    batches: list[int],
    prompts: str = "chat",
    max_new_tokens: int = 64,
    repeats: int = 3,
    draft_model: nn.Module | None = None,
    progress: bool = True,
) -> list[BenchResult]:
    """Measure every technique at every batch size on ``model`` (restored after each technique)."""
    from tqdm.auto import tqdm

    if repeats < 3:
        logger.warning(
            "hf-accel bench: %d timed run(s) per cell: no spread is measured (shown as '-') and one slow run moves "
            "the figures; use --repeats 3 or more for numbers to quote",
            repeats,
        )
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    inputs = {b: tokenizer(load_prompts(prompts, tokenizer, b), return_tensors="pt", padding=True) for b in batches}
    device = next(model.parameters()).device
    results: list[BenchResult] = []
    baseline_out: dict[int, torch.Tensor] = {}
    baseline_rate: dict[int, float] = {}
    base_ppl = perplexity(model, tokenizer) if any(not t.lossless for t in techniques) else None
    total = len(techniques) * len(batches) * (repeats + 1)
    bar = tqdm(total=total, desc="hf-accel bench", disable=not progress, unit="run")
    for tech in techniques:
        compiles = tech.patch is not None and tech.patch.get("compile")
        bar.set_postfix_str(f"{tech.name} (warm-up{' + compile' if compiles else ''})")
        _patch(model, tech)
        try:
            gen_kwargs = dict(tech.generate)
            if gen_kwargs.pop("self_spec", False):
                gen_kwargs.update(_self_spec())
            if tech.name == "draft":
                gen_kwargs["draft_model"] = draft_model
            ppl_delta = None if tech.lossless else (perplexity(model, tokenizer) / base_ppl - 1) * 100
            for batch in batches:
                batch_inputs = {k: v.to(device) for k, v in inputs[batch].items()}
                # a dict output hands back Transformers' own cache, so its KV bytes are measured too
                kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
                row, out = _measure(model, tech, batch, batch_inputs, {**kwargs, **gen_kwargs}, repeats, bar)
                row.ppl_delta_pct = ppl_delta
                if tech.name == "baseline":
                    baseline_out[batch], baseline_rate[batch] = out, row.decode_tok_s
                else:
                    same = torch.equal(out, baseline_out[batch])
                    row.identical = "yes" if same else ("NO" if tech.lossless else "no (lossy)")
                    row.speedup = row.decode_tok_s / baseline_rate[batch]
                results.append(row)
        finally:
            unpatch_model(model)
    bar.close()
    return results


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown_table(results: list[BenchResult]) -> str:
    head = (
        "| technique | batch | TTFT ms | TPOT ms | decode tok/s | speedup | e2e tok/s | KV MiB | peak RSS MiB "
        "| same as baseline | ppl Δ % | acceptance | spread % | gain from |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {r.technique} | {r.batch} | {_fmt(r.ttft_ms, '.0f')} | {_fmt(r.tpot_ms, '.1f')} | "
        f"{_fmt(r.decode_tok_s, '.1f')} | {_fmt(r.speedup, '.2f')}x | {_fmt(r.e2e_tok_s, '.1f')} | "
        f"{_fmt(r.kv_mib, '.1f')} | {_fmt(r.peak_rss_mib, '.0f')} | {r.identical} | "
        f"{_fmt(r.ppl_delta_pct, '+.2f')} | {_fmt(r.acceptance, '.2f')} | {_fmt(r.spread_pct, '.0f')} | "
        f"{r.gain_from or '-'} |"
        for r in results
    ]
    return head + "\n".join(rows) + "\n"


def plot(results: list[BenchResult], path: Path, title: str = "") -> None:
    """A PNG with decode speed-up and KV memory per technique, one bar group per batch size, each bar labelled with
    its value; ``title`` (model, threads, repeats) on top, the legend below the charts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    techniques = list(dict.fromkeys(r.technique for r in results))
    batches = sorted({r.batch for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    width = 0.8 / len(batches)
    for i, batch in enumerate(batches):
        rows = {r.technique: r for r in results if r.batch == batch}
        xs = [j + i * width for j in range(len(techniques))]
        speed = axes[0].bar(
            xs, [rows[t].speedup if t in rows else 0 for t in techniques], width, label=f"batch {batch}"
        )
        axes[0].bar_label(speed, fmt="%.2f", fontsize=7, padding=1)
        kv = axes[1].bar(xs, [(rows[t].kv_mib or 0) if t in rows else 0 for t in techniques], width)
        axes[1].bar_label(kv, fmt="%.1f", fontsize=7, padding=1)
    for ax, name in zip(axes, ("decode speed-up vs baseline (x)", "KV cache in use (MiB)"), strict=True):
        ax.set_xticks([j + width * (len(batches) - 1) / 2 for j in range(len(techniques))])
        ax.set_xticklabels(techniques, rotation=30, ha="right")
        ax.set_title(name)
        ax.margins(y=0.15)  # room for the value labels
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    fig.legend(loc="lower center", ncol=len(batches), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_writable(path: str | None, what: str) -> Path | None:
    """``path`` as a Path after checking its folder exists and is writable (user error otherwise)."""
    if path is None:
        return None
    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise IncompatibleOptionsError(f"{what} {path!r} cannot be written (does its folder exist and is it writable?)")
    return p


def profile(model: nn.Module, tokenizer: Any, trace: Path | None, rows: int = 15) -> str:
    """A torch.profiler run of one prefill and 16 decode steps: the top operators, and a Chrome trace."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inputs = tokenizer(load_prompts("chat", tokenizer, 1), return_tensors="pt")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.inference_mode(), torch_profile(activities=activities) as prof:
        model.generate(**inputs, max_new_tokens=16, do_sample=False)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
