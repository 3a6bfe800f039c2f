#!/usr/bin/env python
"""The compiled paged decode step by region vs whole: first-call time and decode speed, real model, one process.

    python benchmarks/bench_regional.py [--max-new-tokens 64] [--batch 1 8] [--rounds 5] [--cold]

Two copies of the default model are patched with ``fused_mlp=True`` and ``compile=CompileConfig(regional=...)``:
``regional=True`` (the CPU default: one decoder layer's graph serves all layers; embedding, final norm and LM head
eager) and ``regional=False`` (the whole step in one graph). Each is warmed (the first ``generate`` of each batch
size compiles; its wall time is printed), then the two run in alternation, ``--rounds`` times per batch size, so a
machine whose speed drifts (shared hosts) affects both alike; the ratio is the median of the per-round ratios.
``--cold`` points ``TORCHINDUCTOR_CACHE_DIR`` at a new temporary folder first, so first calls include Inductor's
code generation (otherwise its on-disk cache may serve it). Greedy tokens of both are compared with plain
``generate``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import hf_accel
from hf_accel.bench import load_prompts

KINDS = ("regional", "whole")


def _generate(model, inputs, new_tokens: int) -> tuple[float, torch.Tensor]:
    """Decode tokens per second (all rows) of one greedy call, and its output."""
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             paged=True)  # fmt: skip
    return hf_accel.last_stats(model).decode_tokens_per_s, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="an empty Inductor cache (first calls compile fully)")
    args = parser.parse_args()
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hf_accel_inductor_")
    models = {}
    for kind in KINDS:
        model, tok = hf_accel.load_default()
        config = hf_accel.CompileConfig(regional=kind == "regional")
        models[kind] = hf_accel.patch_model(model, fused_mlp=True, compile=config)
    plain, _ = hf_accel.load_default()
    tok.padding_side = "left"
    print(f"threads {torch.get_num_threads()}, cpu {torch.backends.cpu.get_cpu_capability()}, cold cache {args.cold}")
    print("| batch | first call regional s | first call whole s | regional tok/s | whole tok/s | regional / whole "
          "(median of rounds) | greedy = plain |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        inputs = tok(load_prompts("chat", tok, batch), return_tensors="pt", padding=True)
        with torch.inference_mode():
            expected = plain.generate(**inputs, max_new_tokens=args.max_new_tokens,
                                      min_new_tokens=args.max_new_tokens, do_sample=False)  # fmt: skip
        first, same = {}, True
        for kind, model in models.items():
            start = time.perf_counter()
            _, out = _generate(model, inputs, args.max_new_tokens)
            first[kind] = time.perf_counter() - start
            same = same and torch.equal(out, expected)
        rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind, model in models.items():
                rate, out = _generate(model, inputs, args.max_new_tokens)
                rates[kind].append(rate)
                same = same and torch.equal(out, expected)
        ratio = statistics.median(r / w for r, w in zip(rates["regional"], rates["whole"], strict=True))
        regional, whole = statistics.median(rates["regional"]), statistics.median(rates["whole"])
        print(f"| {batch} | {first['regional']:.1f} | {first['whole']:.1f} | {regional:.1f} | {whole:.1f} | "
              f"{ratio:.2f}x | {'yes' if same else 'NO'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
