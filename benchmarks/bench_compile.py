#!/usr/bin/env python
"""End-to-end decode speed of the compile feature vs plain generate, real model, same process.

    python benchmarks/bench_compile.py [--max-new-tokens 128] [--batch 1 8] [--repeats 2] [--skip-slow]

Variants (greedy output compared with the baseline):
  baseline                  plain ``generate`` (hf_accel instrumentation only, so all rows are timed alike)
  default patch             ``patch_model(model)``: on the CPU, the native executor and automatic self-speculation
  HF static+compile         Transformers' own ``cache_implementation="static"`` + ``compile_config`` (CPU allowed)
  packed                    ``compile=CompileConfig(mlp=False)``: linears pre-packed for oneDNN, nothing compiled
  fused+packed              ``fused_mlp=True, compile=CompileConfig(decode_step=False)`` (MLPs are compiled only
                            on accelerators by default)
  ... + paged               the same, ``generate(paged=True)``: eager decode steps over the paged cache
  ... + paged compiled step ``compile=True``, ``generate(paged=True)``: hf_accel compiles the paged decode step
  ... + paged regional step the same with ``CompileConfig(regional=True)``: one decoder layer's graph serves all
  ... + static step         ``compile=True``, ``generate(cache_implementation="static")``: Transformers compiles
                            its decode step over a static cache
Every variant runs on its own copy of the model, patched once; after a warm-up call each, the variants run in
rounds (each once per round), so a host whose speed drifts affects all alike. Prints decode tokens/s (all rows,
median of rounds), time to first token, the ratio to the baseline (median of the per-round ratios), whether greedy
tokens equal the baseline's, and the first call's wall time (compilation included). ``--skip-slow`` drops Transformers'
two whole-step compile variants (about a minute of compilation each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_accel
from hf_accel.bench import load_prompts

# instrumentation only: the CPU default would also turn on the native executor (and self-speculation)
PLAIN = dict(fused_mlp=False, paged=False, speculative=False, native=False)


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
        "default patch": ({}, {}),
        "HF static+compile": (PLAIN, {"cache_implementation": "static", "compile_config": hf_compile_config()}),
        "packed": ({**PLAIN, "compile": hf_accel.CompileConfig(mlp=False, decode_step=False)}, {}),
        "fused+packed": (eager, {}),
        "fused+packed + paged": ({**eager, "paged": True}, {"paged": True}),
        "fused+packed + paged compiled step": ({**compiled, "paged": True}, {"paged": True}),
        "fused+packed + paged regional step": (
            {**compiled, "paged": True, "compile": hf_accel.CompileConfig(regional=True)},
            {"paged": True},
        ),
        "fused+packed + static step": (compiled, {"cache_implementation": "static"}),
    }
    if skip_slow:
        del out["HF static+compile"], out["fused+packed + static step"]
    return out


def run(model, inputs, new_tokens: int, extra: dict) -> tuple[hf_accel.GenerationStats, torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
    return hf_accel.last_stats(model), out


def _patched(skip_slow: bool) -> dict[str, tuple[torch.nn.Module, dict]]:
    """Every variant on its own copy of the default model (patched once, kept for every batch size)."""
    out = {}
    for name, (patch_kwargs, gen_kwargs) in variants(skip_slow).items():
        model, _ = hf_accel.load_default()
        out[name] = (hf_accel.patch_model(model, **patch_kwargs), gen_kwargs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-slow", action="store_true")
    args = parser.parse_args()
    _, tok = hf_accel.load_default()
    tok.padding_side = "left"
    models = _patched(args.skip_slow)
    print("| batch | variant | decode tok/s | vs baseline | TTFT ms | greedy = baseline | first call s |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        inputs = tok(load_prompts("chat", tok, batch), return_tensors="pt", padding=True)
        first, samples = {}, {name: [] for name in models}
        for name, (model, gen_kwargs) in models.items():
            start = time.perf_counter()
            run(model, inputs, args.max_new_tokens, gen_kwargs)  # warm-up; compiles what compiles
            first[name] = time.perf_counter() - start
        for _ in range(args.repeats):  # rounds: every variant once per round, so a drifting host hits all alike
            for name, (model, gen_kwargs) in models.items():
                samples[name].append(run(model, inputs, args.max_new_tokens, gen_kwargs))
        base = samples["baseline"]
        for name, got in samples.items():
            rate = statistics.median(s.decode_tokens_per_s for s, _ in got)
            pairs = zip(got, base, strict=True)
            ratio = statistics.median(s.decode_tokens_per_s / b.decode_tokens_per_s for (s, _), (b, _) in pairs)
            ttft = statistics.median(s.ttft_s for s, _ in got)
            same = "yes" if torch.equal(got[-1][1], base[-1][1]) else "NO"
            print(f"| {batch} | {name} | {rate:.1f} | {ratio:.2f}x | {ttft * 1e3:.0f} | {same} | {first[name]:.1f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
