#!/usr/bin/env python
"""How close the int8 kernels come to this machine's memory bandwidth, on a real model's linear shapes.

    python benchmarks/bench_int8_kernels.py [--rows 1 8] [--rounds 11] [--copies 6]

Builds one int8 weight per linear layer of the default model (every layer distinct, so the weights come
from memory as they do in a decode step: ~134 MB for SmolLM2-135M), then times one pass over all of them per
kernel: weight-only (``int8_linear``), W8A8 (``w8a8_linear``, where the CPU has VNNI) and fp32 ``F.linear``
on the same shapes. The reference is a plain streaming read of the same number of int8 bytes (``amax`` of one
large tensor) measured in the same run: "vs stream" is kernel bandwidth / stream bandwidth. Medians over
interleaved rounds. ``--copies N`` cycles N distinct copies of the int8 weights per pass, for hosts whose last-level
cache could hold one copy (a VM may report hundreds of MB of shared L3): with one copy such a host measures partly
cached reads, not the memory a decode step streams from. The fp32 weights (4x the bytes) stay one copy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import hf_accel
from hf_accel.kernels.ops import choose


def layer_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """``(out, in)`` of every ``nn.Linear`` of the model in call order (decoder layers, then the head)."""
    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def time_once(fn: Callable[[], object], results: list[float]) -> None:
    """Run ``fn`` once and append its wall time (ms) to ``results``."""
    start = time.perf_counter()
    fn()
    results.append((time.perf_counter() - start) * 1e3)


def make_passes(
    xs: dict[int, torch.Tensor], qs: list[torch.Tensor], scales: list[torch.Tensor], floats: list[torch.Tensor],
    stream: torch.Tensor,
) -> dict[str, tuple[Callable[[], object], int]]:  # fmt: skip
    """name -> (one pass over every layer, bytes of weights it reads)."""
    total = stream.numel()
    weight_only, w8a8 = choose("int8_linear", "cpu", group_size=None), choose("w8a8_linear", "cpu", groups=1)
    pairs = list(zip(qs, scales, strict=True))
    passes: dict[str, tuple[Callable[[], object], int]] = {
        "stream read (int8 amax)": (stream.amax, total),
        "fp32 F.linear": (lambda: [F.linear(xs[w.shape[1]], w) for w in floats], 4 * sum(w.numel() for w in floats)),
    }
    if weight_only.native:
        passes[f"int8 weight-only kernel ({weight_only.impl})"] = (
            lambda: [weight_only.fn(xs[q.shape[1]], q, s) for q, s in pairs],
            total,
        )
    if w8a8.native:
        passes[f"int8 W8A8 kernel ({w8a8.impl})"] = (lambda: [w8a8.fn(xs[q.shape[1]], q, s) for q, s in pairs], total)
    return passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="activation rows per call")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--copies", type=int, default=1, help="distinct copies of the int8 weights read per pass")
    args = parser.parse_args()
    model, _ = hf_accel.load_default()
    shapes = layer_shapes(model)
    del model
    torch.manual_seed(0)
    qs = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n, k in shapes * args.copies]  # [N, K] each
    scales = [torch.rand(n, 1) / 127 for n, _ in shapes * args.copies]  # [N, 1]
    floats = [q.float() for q in qs[: len(shapes)]]  # fp32 weights of the same shapes (4x the bytes), one copy
    total = sum(q.numel() for q in qs)
    stream = torch.randint(-127, 128, (total,), dtype=torch.int8)
    print(f"{len(shapes)} linears x {args.copies} copies, {total / 1e6:.0f} MB of int8 weights, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print("| rows | what | ms per pass | GB/s | vs stream |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}  # [M, K]
        passes = make_passes(xs, qs, scales, floats, stream)
        times: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(args.rounds):  # interleaved: slow drifts of the machine hit every pass alike
            for name, (fn, _) in passes.items():
                time_once(fn, times[name])
        stream_bw = total / statistics.median(times["stream read (int8 amax)"]) / 1e6
        for name, (_, nbytes) in passes.items():
            ms = statistics.median(times[name])
            bw = nbytes / ms / 1e6
            print(f"| {rows} | {name} | {ms:.2f} | {bw:.1f} | {bw / stream_bw:.2f} |")


if __name__ == "__main__":
    main()
