#!/usr/bin/env python
"""MLP forward time over all layers of the real model: HF eager vs hf_accel fused (eager, packed, compiled).

    python benchmarks/bench_fused_mlp.py [--repeats 50] [--no-compile]

Variants, all in one process on copies of the same weights:
  HF eager          the model's own MLP modules
  fused eager       ``patch_model(fused_mlp=True)``: one [gate; up] matmul
  fused packed      + ``compile=CompileConfig(mlp=False)``: weights pre-packed for oneDNN, no torch.compile
  fused compiled    + ``compile=True``: pre-packed and ``torch.compile``d (decode shapes; prefill stays eager)
Prints medians and ratios against HF eager, and the first-call compile time; a benchmark, not a test
(machines are noisy: compare ratios).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import hf_accel


def time_layers(mlps, x: torch.Tensor, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for mlp in mlps:
                mlp(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variant")
    args = parser.parse_args()
    model, _ = hf_accel.load_default()
    only = dict(paged=False, speculative=False)
    variants = {
        "HF eager": model,
        "fused eager": hf_accel.patch_model(copy.deepcopy(model), fused_mlp=True, **only),
        "fused packed": hf_accel.patch_model(
            copy.deepcopy(model), fused_mlp=True, compile=hf_accel.CompileConfig(mlp=False), **only
        ),
    }
    if not args.no_compile:
        variants["fused compiled"] = hf_accel.patch_model(copy.deepcopy(model), fused_mlp=True, compile=True, **only)
    mlps = {name: [layer.mlp for layer in m.model.layers] for name, m in variants.items()}
    hidden = model.config.hidden_size
    if "fused compiled" in mlps:
        start = time.perf_counter()
        time_layers(mlps["fused compiled"], torch.randn(1, 1, hidden), 1)
        print(f"first call of the compiled MLPs (compilation): {time.perf_counter() - start:.1f} s")
    names = list(mlps)
    print(f"| input | {' | '.join(f'{n} ms' for n in names)} | {' | '.join(f'{n} speedup' for n in names[1:])} |")
    print(
        "|---|"
        + "---|" * (2 * len(names) - 1)
        + f"  ({len(mlps['HF eager'])} layers, {torch.get_num_threads()} threads)"
    )
    for tokens in (1, 512):
        x = torch.randn(1, tokens, hidden)
        for layers in mlps.values():
            time_layers(layers, x, 3)  # warm-up
        reps = args.repeats if tokens == 1 else max(3, args.repeats // 10)
        times = {name: time_layers(layers, x, reps) for name, layers in mlps.items()}
        base = times["HF eager"]
        cells = " | ".join(f"{t * 1e3:.2f}" for t in times.values())
        ratios = " | ".join(f"{base / times[n]:.2f}x" for n in names[1:])
        print(f"| [1,{tokens},{hidden}] | {cells} | {ratios} |")


if __name__ == "__main__":
    main()
