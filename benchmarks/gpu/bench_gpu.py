"""hf_accel against Transformers on one accelerator: random-weight Llama-shaped models, every baseline in the same run.

Writes ``results.md`` (one Markdown table) and ``results.json`` to ``--out``. Paths, batch 1 (a 128-token prompt):
plain ``generate`` (DynamicCache, sdpa), Transformers static cache + compile, hf_accel paged (eager), paged +
compiled step (CUDA graphs on CUDA), the same with the portable attention and (on CUDA) FlexAttention instead of
the Triton kernel, int8 weights + compiled step (on CUDA also with the de-quantize form in place of the Triton
kernel), and the per-step costs of prompt lookup (a k-token verification chunk against a 1-token step). The 8B
shape runs batch 1 without the other attention candidates, as does ``--shapes moe`` (a mixture of experts:
Qwen3-30B-A3B's layers, 12 of them; with int8 its experts run hf_accel's Triton experts kernel) and
``--shapes gpt-oss`` (GPT-OSS-20B's layers, 6 of them: attention sinks in the paged kernels, biased int8 experts).
Batch 32 of mixed prompt lengths: plain ``generate``, Transformers ``generate_batch`` (continuous batching), hf_accel
paged + compiled and ``Engine`` (with its KV utilisation: tokens held over the slots of the blocks held, per step).
Columns: decode tok/s (after the first token), throughput (all new tokens over the whole call), time to first token,
peak memory, speed over plain ``generate`` at the same batch (decode tok/s where a path has it, else throughput),
whether greedy tokens equal plain's, and on CUDA the host synchronisations per new token (CUDA's sync debug mode, one
more call).

    python benchmarks/gpu/bench_gpu.py --device cuda --shapes 1b,8b --out OUT   # what check.sh runs
    python benchmarks/gpu/bench_gpu.py --device cpu --shapes tiny --new-tokens 8 --backend eager  # CPU smoke
    python benchmarks/gpu/bench_gpu.py --device cuda --shapes moe --out OUT     # SKIP_TESTS=1 SHAPES=moe check.sh
    python benchmarks/gpu/bench_gpu.py --device cuda --shapes gpt-oss --out OUT  # SKIP_TESTS=1 SHAPES=gpt-oss
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import hf_accel
from hf_accel import CompileConfig, Engine, Int8Config, PagedCache, PagedConfig, SpeculativeConfig
from hf_accel.quant.linear import Int8Linear

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B geometry; "tiny" for CPU smoke runs
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer (128 experts of 768, 8 per token) in 12 of its 48 layers (~7.8B parameters): a
    # mixture of experts, run by Transformers' grouped_mm in bf16, by Int8Experts with int8= (SHAPES=moe)
    "moe": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_experts=128, num_experts_per_tok=8, num_hidden_layers=12, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True),
    # GPT-OSS-20B's layer (32 experts of 2880 with biases, 4 per token; attention sinks; a 128-token window on
    # alternate layers) in 6 of its 24 layers (~6.1B parameters); Transformers runs it with eager attention (no SDPA)
    "gpt-oss": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                    num_experts_per_tok=4, num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, sliding_window=128, vocab_size=201088, tie_word_embeddings=False, attn="eager"),
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=256, intermediate_size=256, num_local_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32, sliding_window=16, vocab_size=2048, tie_word_embeddings=True, attn="eager"),
}  # fmt: skip
#: the shapes that run batch 1 and the int8 comparison only
BIG = ("8b", "moe", "gpt-oss")
PROMPT = 128
PLAIN = dict(compile=False, native=False, speculative=SpeculativeConfig(auto=None))


def build(shape: str, device: str, dtype: torch.dtype) -> Any:
    fields = dict(SHAPES[shape])
    model_type, attn = fields.pop("model_type", None), fields.pop("attn", "sdpa")
    if model_type is None:
        config = LlamaConfig(**fields, max_position_embeddings=4096, rope_theta=500000.0)
    else:
        config = AutoConfig.for_model(model_type, **fields, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def host_syncs(call: Callable[[], Any], device: str) -> int | None:
    """How many times ``call`` made the host wait for the device (CUDA's sync debug mode warns at each)."""
    if not device.startswith("cuda"):
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


#: The rows of the shape being measured, as each is measured: what a stop (check.sh's ``timeout``) keeps.
MEASURED: list[dict[str, Any]] = []


class Stopped(BaseException):
    """SIGTERM (check.sh's ``timeout``): past every ``except Exception``, to the writing of what was measured."""


def guarded(name: str, batch: int, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``, or a row that names the exception: one failing path must not lose the others' figures. The
    row is also kept in :data:`MEASURED`."""
    try:
        row = measure()
    except Exception as err:
        traceback.print_exc()
        row = {"path": name, "batch": batch, "error": f"{type(err).__name__}: {err}"[:300]}
    MEASURED.append(row)
    print(f"measured: {row['path']} (batch {row['batch']})", flush=True)
    return row


def generate_row(name: str, call: Callable[[int], Any], rows: int, new: int, device: str) -> dict[str, Any]:
    """Warm up (compiles, graph captures), then time 1 and ``new`` tokens: TTFT and decode tok/s; then count the
    host syncs of one more call, per new token. A failure is a row with its error."""
    return guarded(name, rows, lambda: _generate_row(name, call, rows, new, device))


def _generate_row(name: str, call: Callable[[int], Any], rows: int, new: int, device: str) -> dict[str, Any]:
    call(new)
    peak_reset(device)
    ttft, _ = timed(lambda: call(1), device)
    total, out = timed(lambda: call(new), device)
    decode = rows * (new - 1) / max(total - ttft, 1e-9)
    syncs = host_syncs(lambda: call(new), device)
    return {"path": name, "batch": rows, "decode_tok_s": decode, "throughput_tok_s": rows * new / total,
            "ttft_s": ttft, "peak_gib": peak_gib(device), "syncs_per_token": None if syncs is None else syncs / new,
            "tokens": out}  # fmt: skip


def batch1(model: Any, device: str, new: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), device=device)
    mask = torch.ones_like(ids)
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=None)

    def gen(**kw: Any) -> Callable[[int], Any]:
        return lambda n: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, **greedy, **kw)

    rows = [generate_row("plain generate", gen(), 1, new, device)]
    from transformers import CompileConfig as HFCompile

    hf_compile = HFCompile(backend=args.backend, mode=None if args.backend != "inductor" else "reduce-overhead")
    hf_compile._compile_all_devices = True
    name = "Transformers static + compile"
    if out_of_time(args):  # the baselines come first; a shape started late still measures plain generate
        return [*rows, {"path": name, "batch": 1, "skipped": "time budget"}]
    rows.append(generate_row(name, gen(cache_implementation="static", compile_config=hf_compile), 1, new, device))
    return rows + patched_rows(model, gen, ids, device, new, args)


def out_of_time(args: argparse.Namespace) -> bool:
    return bool(args.deadline) and time.monotonic() > args.deadline


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], bool]]:
    """The hf_accel paths of batch 1: (name, patch_model keywords, int8 linears in the graph as the de-quantize
    form instead of the Triton kernel)."""
    compiled = CompileConfig(backend=args.backend, prepack=False)
    int8 = Int8Config(backend="native", keep_original=True)  # restored bitwise: later paths see the same weights
    out = [("hf_accel paged", dict(PLAIN), False),
           ("hf_accel paged + compiled step", dict(PLAIN, compile=compiled), False),
           ("hf_accel int8 + compiled step", dict(PLAIN, compile=compiled, int8=int8), False)]  # fmt: skip
    if args.device.startswith("cuda"):  # the other in-graph int8 form (docs/cuda.md: chosen by measurement)
        out.append(("hf_accel int8 + compiled step, de-quantize form in the graph", out[-1][1], True))
    if not args.big:  # the other attention candidates (FlexAttention: CUDA only)
        others = ["batched", "flex"] if args.device.startswith("cuda") else ["batched"]
        names = {"batched": "portable attention", "flex": "FlexAttention"}
        for mode in others:
            out.append((f"hf_accel paged + compiled step, {names[mode]}",
                        dict(PLAIN, compile=compiled, paged=PagedConfig(attention=mode)), False))  # fmt: skip
    return out


def patched_rows(model: Any, gen: Callable[..., Any], ids: torch.Tensor, device: str, new: int,
                 args: argparse.Namespace) -> list[dict[str, Any]]:  # fmt: skip
    rows: list[dict[str, Any]] = []
    for name, patch, dequantize in variants(args):
        if out_of_time(args):
            rows.append({"path": name, "batch": 1, "skipped": "time budget"})
            continue
        try:
            hf_accel.patch_model(model, **patch)
        except Exception as err:
            traceback.print_exc()
            rows.append({"path": name, "batch": 1, "error": f"patch_model: {type(err).__name__}: {err}"[:300]})
            MEASURED.append(rows[-1])
            continue
        if dequantize:  # every Int8Linear on its portable forms instead of the Triton kernel
            for module in model.modules():
                if isinstance(module, Int8Linear):
                    module.use_device_kernel(False)
        try:
            rows.append(generate_row(name, gen(paged=True), 1, new, device))
            rows[-1]["report"] = hf_accel.patch_report(model)["implementations"]
            if "compiled step" in name and not dequantize:
                attention = patch.get("paged", PagedConfig()).attention  # the variant's attention, not the default
                costs = functools.partial(verification_costs, model, ids, device, name, attention)
                rows.append(guarded(name, 1, costs))
        finally:
            hf_accel.unpatch_model(model)
    return rows


def verification_costs(
    model: Any, ids: torch.Tensor, device: str, name: str, attention: str = "auto", k: int = 4
) -> dict[str, Any]:
    """Prompt lookup's per-step costs: one k-token verification chunk against one 1-token step (compiled)."""
    cache = PagedCache(model, num_blocks=64, block_size=16, attention=attention)
    mask = torch.ones_like(ids)
    times: dict[int, list[float]] = {1: [], k: []}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, logits_to_keep=1)
        for width in (1, k) * 6:  # the first round compiles / captures; the median of the other five counts
            chunk = ids[:, :width]
            mask = torch.cat([mask, torch.ones_like(chunk)], 1)
            seconds, _ = timed(lambda c=chunk, m=mask: model(input_ids=c, attention_mask=m, cache=cache), device)
            times[width].append(seconds)
    step, verify = (sorted(times[w][1:])[2] * 1e3 for w in (1, k))
    return {"path": f"{name}: verify {k} tokens / 1-token step", "batch": 1, "step_ms": step, "verify_ms": verify,
            "verify_over_step": verify / step}  # fmt: skip


def mixed_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 2 * PROMPT))] for _ in range(count)]


def batch32(model: Any, device: str, new: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = mixed_prompts(model.config.vocab_size, args.batch)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    rows = [generate_row("plain generate", lambda n: model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, **greedy), len(prompts), new, device)]  # fmt: skip
    rows.append(guarded("Transformers generate_batch", len(prompts), lambda: transformers_batch(model, prompts, new,
                                                                                                device)))  # fmt: skip
    hf_accel.patch_model(model, **dict(PLAIN, compile=CompileConfig(backend=args.backend, prepack=False)))
    try:
        rows.append(
            generate_row(
                "hf_accel paged + compiled step",
                lambda n: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, paged=True, **greedy),
                len(prompts),
                new,
                device,
            )
        )
        rows.append(guarded("hf_accel Engine", len(prompts), lambda: engine_row(model, prompts, new, device)))
    finally:
        hf_accel.unpatch_model(model)
    return rows


def transformers_batch(model: Any, prompts: list[list[int]], new: int, device: str) -> dict[str, Any]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs: dict[str, Any] = {}
    if device == "cpu":  # by default its cache takes most of the free memory, zeroed on every call (8 s here)
        from transformers import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=1024)
    try:
        model.generate_batch(inputs=prompts[:2], generation_config=config, **kwargs)  # warm-up
        peak_reset(device)
        seconds, _ = timed(lambda: model.generate_batch(inputs=prompts, generation_config=config, **kwargs), device)
    except Exception as err:  # an older Transformers, or a device it does not serve: said in the table
        return {"path": "Transformers generate_batch", "batch": len(prompts), "skipped": f"{type(err).__name__}: {err}"}
    return {"path": "Transformers generate_batch", "batch": len(prompts), "throughput_tok_s":
            len(prompts) * new / seconds, "peak_gib": peak_gib(device)}  # fmt: skip


def engine_row(model: Any, prompts: list[list[int]], new: int, device: str) -> dict[str, Any]:
    def run(batch: list[list[int]]) -> list[float]:
        engine = Engine(model, max_batch_tokens=2048, max_running=len(batch), paged=PagedConfig(block_size=16))
        for p in batch:
            engine.add_request(p, max_new_tokens=new, eos_token_id=None)
        seen, manager, block = [], engine.cache.manager, engine.cache.block_size
        while engine.step():  # held tokens over the slots of the blocks the running sequences hold
            seqs = manager.sequences()
            slots = sum(len(manager.block_table(q)) for q in seqs) * block
            if slots:
                seen.append(sum(manager.num_tokens(q) for q in seqs) / slots)
        return seen

    run(prompts[:2])  # warm-up
    peak_reset(device)
    seconds, seen = timed(lambda: run(prompts), device)
    return {"path": "hf_accel Engine", "batch": len(prompts), "throughput_tok_s": len(prompts) * new / seconds,
            "peak_gib": peak_gib(device), "kv_utilisation_mean": sum(seen) / max(1, len(seen)),
            "kv_utilisation_min": min(seen, default=0.0)}  # fmt: skip


def ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's speed over plain ``generate`` at the same batch, and whether its tokens equal plain's."""
    for row in rows:
        base = next((r for r in rows if r["path"] == "plain generate" and r["batch"] == row["batch"]), None)
        if base is None or row is base:
            continue
        key = "decode_tok_s" if "decode_tok_s" in row else "throughput_tok_s"
        if row.get(key) and base.get(key):  # a failed or skipped row has neither
            row["vs_plain"] = row[key] / base[key]
        if row.get("tokens") is not None and base.get("tokens") is not None:
            row["same_tokens"] = bool(torch.equal(row["tokens"], base["tokens"]))
    for row in rows:
        row.pop("tokens", None)


def table(results: dict[str, list[dict[str, Any]]], header: str) -> str:
    cols = ["path", "batch", "decode_tok_s", "throughput_tok_s", "vs_plain", "ttft_s", "peak_gib", "same_tokens",
            "syncs_per_token",
            "step_ms", "verify_ms", "kv_utilisation_mean", "kv_utilisation_min", "skipped", "error"]  # fmt: skip
    lines = [header, ""]
    for shape, rows in results.items():
        lines += [f"### {shape}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in rows:
            cells = [f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def measure_shape(shape: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every path of one model shape (a failure to build the model is the shape's one row)."""
    try:
        model = build(shape, args.device, getattr(torch, args.dtype))
    except Exception as err:
        traceback.print_exc()
        return [{"path": "build the model", "batch": 0, "error": f"{type(err).__name__}: {err}"[:300]}]
    args.big = shape in BIG  # batch 1 and the int8 comparison only
    rows = batch1(model, args.device, args.new_tokens, args)
    if not args.big and not out_of_time(args):
        rows += batch32(model, args.device, args.new_tokens, args)
    ratios(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--budget-s", type=float, default=0, help="skip paths that would start after this (0: none)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu/out"))
    args = parser.parse_args(argv)
    args.deadline = time.monotonic() + args.budget_s if args.budget_s else 0
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{args.device} ({sys.platform})"
    header = f"## {name}: torch {torch.__version__}, {args.dtype}, {args.new_tokens} new tokens, prompt {PROMPT}"
    results: dict[str, list[dict[str, Any]]] = {}
    signal.signal(signal.SIGTERM, _stop)
    try:
        for shape in args.shapes.split(","):
            MEASURED.clear()
            results[shape] = measure_shape(shape, args)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            write(args.out, name, header, results)
    except Stopped:  # the shape's rows measured so far, then the time-out's exit status
        ratios(MEASURED)
        results[f"{shape} (stopped by SIGTERM)"] = MEASURED
        write(args.out, name, header, results)
        print(table(results, header))
        return 124
    print(table(results, header))
    return 0


def _stop(signum: int, frame: Any) -> None:
    raise Stopped


def write(out: Path, name: str, header: str, results: dict[str, list[dict[str, Any]]]) -> None:
    (out / "results.json").write_text(json.dumps({"device": name, "results": results}, indent=1, default=str))
    (out / "results.md").write_text(table(results, header))


if __name__ == "__main__":
    raise SystemExit(main())
