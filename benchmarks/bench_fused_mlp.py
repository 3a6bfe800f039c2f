#!/usr/bin/env python
"""MLP forward time over all layers of the real model: HF eager vs hf_accel fused eager, same run.

    python benchmarks/bench_fused_mlp.py [--repeats 50]

Prints medians and the ratio; a benchmark, not a test (machines are noisy: compare ratios).
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
    args = parser.parse_args()
    model, _ = hf_accel.load_default()
    plain = [layer.mlp for layer in model.model.layers]
    fused_model = hf_accel.patch_model(copy.deepcopy(model), fused_mlp=True)
    fused = [layer.mlp for layer in fused_model.model.layers]
    hidden = model.config.hidden_size
    print(
        f"| input | HF eager ms | fused eager ms | speedup |  ({len(plain)} layers, {torch.get_num_threads()} threads)"
    )
    print("|---|---|---|---|")
    for tokens in (1, 512):
        x = torch.randn(1, tokens, hidden)
        time_layers(plain, x, 3), time_layers(fused, x, 3)  # warm-up
        reps = args.repeats if tokens == 1 else max(3, args.repeats // 10)
        t_plain, t_fused = time_layers(plain, x, reps), time_layers(fused, x, reps)
        print(f"| [1,{tokens},{hidden}] | {t_plain * 1e3:.2f} | {t_fused * 1e3:.2f} | {t_plain / t_fused:.2f}x |")


if __name__ == "__main__":
    main()
