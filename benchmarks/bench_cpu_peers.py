"""One run, every CPU path of issue 32 side by side: the memory-bandwidth limit, plain Transformers fp32 / bf16, each
hf_accel precision and path, and llama.cpp on GGUF files when ``llama-cpp-python`` is importable.

    python benchmarks/bench_cpu_peers.py [--new-tokens 64] [--repeats 3] [--ppl-tokens 2048] [--paths REGEX]
                                         [--gguf f32.gguf bf16.gguf q8_0.gguf] [--shared-process]

Each path runs in a fresh process (the bandwidth limit and the GEMM peak are measured first, in this one): in one
shared process, paths that ran after others were up to 35% slower.

Prints, per path: decode tok/s on a short chat prompt, decode tok/s and TTFT on a 388-token prompt, the decode rate
as a share of the bandwidth limit for its weight bytes (speculative paths can pass 100%: several tokens per weight
read), how many of the new tokens equal Transformers fp32's greedy
ones, the perplexity change against Transformers fp32 on the first ``--ppl-tokens`` tokens of the GPL-3 text (every
path; llama.cpp's too, from its logits over the same token ids), and which kernel builds hf_accel ran
(``patch_report``). Speed is never asserted: read the ratios of one run. ``ATEN_CPU_CAPABILITY=avx2`` (with
``MKL_ENABLE_INSTRUCTIONS=AVX2``) runs everything as on an AVX2-only CPU: hf_accel then takes its AVX2 builds.
The GGUF files (llama.cpp's ``convert_hf_to_gguf.py`` on the converted default model, ``--outtype f32 / bf16 /
q8_0``) are optional; ``pip install -e .[peers]`` builds ``llama-cpp-python`` (6-25 minutes, so never part of CI; in
a VM without AMX tile state pass the CMAKE_ARGS of docs/log/2026-12-06-cpu-peers.md, or its Q8_0 path faults).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hf_accel
from hf_accel.core.metrics import TimingStreamer
from hf_accel.quant.codes import Codes, find_codes

LICENSE = Path("/usr/share/common-licenses/GPL-3")
CHAT = "Write a short poem about the sea."
GGUF_PREFIX = "gguf:"
ROW_MARK = "ROW "


def bandwidth_gbs(gib: int = 2) -> float:
    """Read bandwidth: ``torch.sum`` over ``gib`` GiB of float32 (the best of 3)."""
    x = torch.ones(gib * 2**28)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def gemm_gflops(n: int = 2048) -> float:
    """The CPU's measured fp32 peak: ``torch.mm`` of two ``n x n`` float32 matrices (the best of 5), GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def _prompt_gflop(model: Any, tokens: int) -> float:
    """A prompt's products: every decoder linear on ``tokens`` rows (the head runs on the last row only) and causal
    attention (``Q K^T`` and ``P V`` over the lower triangle)."""
    linears = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n
    )
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 2 * 2 * (tokens * tokens / 2) * head_dim * config.num_attention_heads * config.num_hidden_layers
    return (2 * linears * tokens + attention) / 1e9


def _text() -> str:
    return LICENSE.read_text() if LICENSE.is_file() else "The quick brown fox jumps over the lazy dog. " * 800


def _prompts(tokenizer: Any) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": CHAT}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    long = tokenizer(_text())["input_ids"][:388]
    return {"chat": chat["input_ids"], "388": torch.tensor([long])}


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood: ``logits [T, V]`` over ``ids [T]``."""
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:]))


def _ppl_hf(model: Any, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        logits = model(input_ids=ids[None], use_cache=False).logits[0]  # [T, V]
    return math.exp(_nll(logits, ids))


def _ppl_llama(path: str, ids: torch.Tensor) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=2, n_ctx=ids.numel(), n_batch=512, logits_all=True, verbose=False)
    llm.eval(ids.tolist())
    logits = torch.from_numpy(llm.scores[: ids.numel()].copy())  # [T, V]
    del llm
    return math.exp(_nll(logits, ids))


def _host() -> str:
    flags = set()
    if Path("/proc/cpuinfo").is_file():
        line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
        flags = set(line.split(":", 1)[-1].split())
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{platform.processor() or platform.machine()}, flags {' '.join(shown)}; torch capability {capability}" + (
        f" (ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']})" if "ATEN_CPU_CAPABILITY" in os.environ else ""
    )


def _time_hf(model: Any, ids: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    streamer = TimingStreamer()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, eos_token_id=None,
                             do_sample=False, streamer=streamer)  # fmt: skip
    timing = streamer.timing()
    return timing.decode_tokens_per_s, timing.ttft_s, out[0, ids.shape[1] :].tolist()


def _time_llama(llm: Any, ids: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    llm.reset()
    start, stamps, tokens = time.perf_counter(), [], []
    for token in llm.generate(ids[0].tolist(), temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == new:
            break
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), stamps[0] - start, tokens


def _paths(model: Any) -> dict[str, tuple[Callable[[], Any], str]]:
    """Label -> (a function building that model, the weight precision its bandwidth limit uses)."""
    int8 = hf_accel.Int8Config(keep_original=True)

    def patched(dtype: torch.dtype, **features: Any) -> Callable[[], Any]:
        return lambda: hf_accel.patch_model(copy.deepcopy(model).to(dtype), **features)

    return {
        "Transformers fp32": (lambda: copy.deepcopy(model), "fp32"),
        "Transformers bf16": (lambda: copy.deepcopy(model).to(torch.bfloat16), "bf16"),
        "hf_accel default (fp32)": (patched(torch.float32), "codes"),
        "hf_accel native (fp32, no speculation)": (
            patched(torch.float32, speculative=hf_accel.SpeculativeConfig()), "codes"),
        "hf_accel native (fp32, no speculation, exact_codes=False)": (
            patched(torch.float32, speculative=hf_accel.SpeculativeConfig(),
                    native=hf_accel.NativeConfig(exact_codes=False)), "fp32"),
        "hf_accel native=True (bf16 model: executor)": (patched(torch.bfloat16, native=True), "bf16"),
        "hf_accel int8 + native (fp32 activations)": (patched(torch.float32, int8=int8), "int8"),
        "hf_accel W8A8 + native": (patched(torch.float32, int8=hf_accel.Int8Config(activations="int8")), "int8"),
        "hf_accel int8 + native=True (bf16 model)": (patched(torch.bfloat16, int8=int8, native=True), "int8"),
    }  # fmt: skip


def _builds(model: Any) -> str:
    if not hf_accel.is_patched(model):
        return "-"
    found = {c["uses"] for per in hf_accel.patch_report(model)["implementations"].values() for c in per.values()}
    return ", ".join(sorted(u for u in found if u.startswith("cpu/"))) or "-"


def _run(timer: Callable[..., Any], target: Any, prompts: dict[str, torch.Tensor], new: int, repeats: int) -> dict:
    timer(target, prompts["chat"], 4)  # warm-up: kernel builds, drafts, first-call allocations
    chat = [timer(target, prompts["chat"], new) for _ in range(repeats)]
    long = [timer(target, prompts["388"], new) for _ in range(repeats)]
    return {
        "chat": statistics.median(r[0] for r in chat),
        "long": statistics.median(r[0] for r in long),
        "ttft": statistics.median(r[1] for r in long),
        "tokens": chat[-1][2],
    }


def _gguf_row(path: str, prompts: dict[str, torch.Tensor], text: torch.Tensor, args: Any) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not importable: the GGUF rows are skipped")
        return None
    llm = Llama(model_path=path, n_threads=2, n_ctx=1024, verbose=False)
    name = Path(path).name.lower()
    precision = "int8" if "q8" in name else "bf16" if "bf16" in name else "codes" if "q4_1" in name else "fp32"
    row = _run(_time_llama, llm, prompts, args.new_tokens, args.repeats)
    del llm
    ppl = _ppl_llama(path, text) if args.ppl_tokens else None
    return {**row, "precision": precision, "builds": "llama.cpp", "ppl": ppl}


def _code_bytes(model: Any) -> int:
    """Bytes a decode step reads where the float32 weights run from their exact codes (hf_accel.quant.codes: the
    default model is a de-quantized Q4_1 / Q8_0 GGUF): codes and (scale, offset) pairs, float32 elsewhere."""
    total = 0
    for param in model.parameters():
        codes = find_codes(param.detach()) if param.dim() == 2 else None
        total += codes.nbytes if isinstance(codes, Codes) else param.numel() * param.element_size()
    return total


def _print(rows: dict, limit: dict[str, float], ppl_tokens: int, prefill_gflop: float, peak: float) -> None:
    reference = rows["Transformers fp32"]["tokens"]
    base = rows["Transformers fp32"]["ppl"]
    columns = [
        "path", "chat tok/s", "388-token prompt: tok/s / TTFT (prefill GFLOP/s, % of fp32 peak)", "% of its limit",
        f"= fp32 greedy (of {len(reference)})", f"perplexity, {ppl_tokens} tokens (vs fp32)", "kernel builds",
    ]  # fmt: skip
    print("\n| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], reference, strict=False)) if a != b), len(reference))
        share = 100 * r["chat"] / limit[r["precision"]]
        ppl = (
            "-"
            if r["ppl"] is None
            else f"{r['ppl']:.3f}" + ("" if base is None else f" ({(r['ppl'] / base - 1) * 100:+.2f}%)")
        )
        rate = prefill_gflop / r["ttft"]
        prefill = f"{r['long']:.1f} / {r['ttft']:.2f} s ({rate:.0f}, {100 * rate / peak:.0f}%)"
        print(f"| {label} | {r['chat']:.1f} | {prefill} | {share:.0f}% ({r['precision']}) "
              f"| {same} | {ppl} | {r['builds']} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="0: no perplexity")
    parser.add_argument("--paths", default="", help="regex: only the hf_accel / Transformers paths it matches "
                        "(Transformers fp32 always runs: the reference)")  # fmt: skip
    parser.add_argument("--gguf", nargs="*", default=[], help="llama.cpp GGUF files of the same weights")
    parser.add_argument("--shared-process", action="store_true", help="run every path in this process (by default "
                        "each runs in a fresh one: paths run after others here were up to 35%% slower)")  # fmt: skip
    parser.add_argument("--only", help=argparse.SUPPRESS)  # internal: one path, its row as JSON on stdout
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = hf_accel.load_default()
    prompts = _prompts(tokenizer)
    text = torch.tensor(tokenizer(_text())["input_ids"][: args.ppl_tokens])
    if args.only is not None:
        print(ROW_MARK + json.dumps(_row(args.only, model, prompts, text, args)))
        return
    gbs, peak = bandwidth_gbs(), gemm_gflops()
    params = sum(p.numel() for p in model.parameters())
    prefill_gflop = _prompt_gflop(model, prompts["388"].shape[1])
    limit = {"fp32": gbs * 1e9 / (4 * params), "bf16": gbs * 1e9 / (2 * params), "int8": gbs * 1e9 / params,
             "codes": gbs * 1e9 / _code_bytes(model)}  # fmt: skip
    print(f"host: {_host()}")
    print(f"read bandwidth {gbs:.1f} GB/s: batch-1 decode limit fp32 {limit['fp32']:.0f}, bf16 {limit['bf16']:.0f}, "
          f"int8 {limit['int8']:.0f}, exact codes {limit['codes']:.0f} tok/s; torch threads "
          f"{torch.get_num_threads()}")  # fmt: skip
    print(f"fp32 peak (torch.mm 2048^3) {peak:.0f} GFLOP/s; a 388-token prompt's products: {prefill_gflop:.1f} GFLOP")
    labels = [label for label in _paths(model) if label == "Transformers fp32" or re.search(args.paths, label)]
    labels += [f"{GGUF_PREFIX}{path}" for path in args.gguf]
    del model
    rows = {}
    for label in labels:
        row = _row(label, None, prompts, text, args) if args.shared_process else _row_apart(label)
        name = f"llama.cpp {Path(label[len(GGUF_PREFIX) :]).name}" if label.startswith(GGUF_PREFIX) else label
        if row is not None:
            rows[name] = row
    _print(rows, limit, args.ppl_tokens, prefill_gflop, peak)


def _row(label: str, model: Any, prompts: dict[str, torch.Tensor], text: torch.Tensor, args: Any) -> dict | None:
    """One path's row (a GGUF file where ``label`` starts with :data:`GGUF_PREFIX`); ``None`` where it cannot run."""
    if label.startswith(GGUF_PREFIX):
        return _gguf_row(label[len(GGUF_PREFIX) :], prompts, text, args)
    model = model if model is not None else hf_accel.load_default()[0]
    build, precision = _paths(model)[label]
    target = build()
    row = _run(_time_hf, target, prompts, args.new_tokens, args.repeats)
    ppl = _ppl_hf(target, text) if args.ppl_tokens else None
    row = {**row, "precision": precision, "builds": _builds(target), "ppl": ppl}
    del target
    gc.collect()
    return row


def _row_apart(label: str) -> dict | None:
    """:func:`_row` in a fresh process (this script with ``--only``), so no path runs in the wake of another's."""
    forwarded = [a for a in sys.argv[1:] if a != "--shared-process"]
    done = subprocess.run([sys.executable, __file__, *forwarded, "--only", label], capture_output=True, text=True)
    found = [line for line in done.stdout.splitlines() if line.startswith(ROW_MARK)]
    if done.returncode or not found:
        print(f"{label}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(found[-1][len(ROW_MARK) :])


if __name__ == "__main__":
    main()
