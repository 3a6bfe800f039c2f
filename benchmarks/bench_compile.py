#!/usr/bin/env python
"""End-to-end decode speed of the compile feature vs plain generate, real model, same process.

    python benchmarks/bench_compile.py [--max-new-tokens 128] [--batch 1 8] [--repeats 2] [--skip-slow]

Variants (each patched onto the same model, run, unpatched; greedy output compared with the baseline):
  baseline                  plain ``generate`` (hf_accel instrumentation only, so all rows are timed alike)
  HF static+compile         Transformers' own ``cache_implementation="static"`` + ``compile_config`` (CPU allowed)
  packed                    ``compile=CompileConfig(mlp=False)``: linears pre-packed for oneDNN, nothing compiled
  fused+packed              ``fused_mlp=True, compile=CompileConfig(decode_step=False)`` (MLPs are compiled only
                            on accelerators by default)
  ... + paged               the same, ``generate(paged=True)``: eager decode steps over the paged cache
  ... + paged compiled step ``compile=True``, ``generate(paged=True)``: hf_accel compiles the paged decode step
  ... + static step         ``compile=True``, ``generate(cache_implementation="static")``: Transformers compiles
                            its decode step over a static cache
Prints decode tokens/s (all rows), time to first token, the ratio to the baseline, whether greedy tokens equal
the baseline's, and the first call's wall time (compilation included). ``--skip-slow`` drops Transformers'
two whole-step compile variants (about a minute of compilation each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_accel
from hf_accel.bench import load_prompts

PLAIN = dict(fused_mlp=False, paged=False, speculative=False)


def hf_compile_config():
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # Transformers compiles on accelerators only unless told
    return config


def variants(skip_slow: bool) -> dict[str, tuple[dict, dict]]:
    """name -> (patch_model kwargs, generate kwargs)."""
    eager = {**PLAIN, "fused_mlp": True, "compile": hf_accel.CompileConfig(decode_step=False)}
    compiled = {**PLAIN, "fused_mlp": True, "compile": True}
    out = {
        "baseline": (PLAIN, {}),
        "HF static+compile": (PLAIN, {"cache_implementation": "static", "compile_config": hf_compile_config()}),
        "packed": ({**PLAIN, "compile": hf_accel.CompileConfig(mlp=False, decode_step=False)}, {}),
        "fused+packed": (eager, {}),
        "fused+packed + paged": ({**eager, "paged": True}, {"paged": True}),
        "fused+packed + paged compiled step": ({**compiled, "paged": True}, {"paged": True}),
        "fused+packed + static step": (compiled, {"cache_implementation": "static"}),
    }
    if skip_slow:
        del out["HF static+compile"], out["fused+packed + static step"]
    return out


def run(model, inputs, new_tokens: int, extra: dict) -> tuple[hf_accel.GenerationStats, torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
    return hf_accel.last_stats(model), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-slow", action="store_true")
    args = parser.parse_args()
    model, tok = hf_accel.load_default()
    tok.padding_side = "left"
    print("| batch | variant | decode tok/s | vs baseline | TTFT ms | greedy = baseline | first call s |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        inputs = tok(load_prompts("chat", tok, batch), return_tensors="pt", padding=True)
        base_rate, base_out = None, None
        for name, (patch_kwargs, gen_kwargs) in variants(args.skip_slow).items():
            hf_accel.patch_model(model, **patch_kwargs)
            try:
                start = time.perf_counter()
                run(model, inputs, args.max_new_tokens, gen_kwargs)  # warm-up; compiles what compiles
                first = time.perf_counter() - start
                samples = [run(model, inputs, args.max_new_tokens, gen_kwargs) for _ in range(args.repeats)]
            finally:
                hf_accel.unpatch_model(model)
            rate = statistics.median(s.decode_tokens_per_s for s, _ in samples)
            ttft = statistics.median(s.ttft_s for s, _ in samples)
            out = samples[-1][1]
            if base_rate is None:
                base_rate, base_out = rate, out
            same = "yes" if torch.equal(out, base_out) else "NO"
            print(
                f"| {batch} | {name} | {rate:.1f} | {rate / base_rate:.2f}x | {ttft * 1e3:.0f} | {same} | "
                f"{first:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
