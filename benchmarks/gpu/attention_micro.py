"""Paged decode attention alone: the reference's per-row loop, the portable whole-batch implementation and (on CUDA)
the Triton kernel, on one batch of mixed context lengths. Prints milliseconds per call (median of 20 after warm-up).

    python benchmarks/gpu/attention_micro.py --device cuda --batch 32 --max-context 2048
    python benchmarks/gpu/attention_micro.py --device cpu   # docs/log/2026-12-06-cuda-cpu-side.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hf_accel.kernels import portable, reference, triton_paged


def case(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Rows with random contexts in [16, max_context], each owning consecutive blocks; one decode query per row."""
    torch.manual_seed(0)
    rng = random.Random(0)
    lengths = [rng.randint(16, args.max_context) for _ in range(args.batch)]
    width = max((n + args.block - 1) // args.block for n in lengths)
    dtype = getattr(torch, args.dtype)
    pools = torch.randn(2, args.batch * width + 1, args.block, args.kv_heads, args.head_dim, dtype=dtype)
    tables = torch.arange(args.batch * width, dtype=torch.int32).view(args.batch, width)
    q_pos = torch.tensor([[n - 1] for n in lengths], dtype=torch.int32)
    query = torch.randn(args.batch, args.heads, 1, args.head_dim, dtype=dtype)
    return tuple(t.to(args.device) for t in (query, pools[0], pools[1], tables, q_pos))


def timed_ms(fn, tensors: tuple[torch.Tensor, ...], device: str) -> float:
    scale = tensors[0].shape[-1] ** -0.5
    fn(*tensors, scale, 0, 0.0)
    times = []
    for _ in range(20):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*tensors, scale, 0, 0.0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    args = parser.parse_args()
    tensors = case(args)
    paths = {"reference (per-row loop)": reference.paged_attention, "portable (whole batch)": portable.paged_attention}
    if args.device.startswith("cuda") and triton_paged.load()[0] is not None:
        paths["triton (one launch)"] = triton_paged.paged_attention
    for name, fn in paths.items():
        print(f"{name}: {timed_ms(fn, tensors, args.device):.3f} ms")


if __name__ == "__main__":
    main()
