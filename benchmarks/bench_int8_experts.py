#!/usr/bin/env python
"""int8 experts on a mixture-of-experts model, one process (docs/log/2026-12-07-moe-int8.md).

    python benchmarks/bench_int8_experts.py forms      # float32 / int8 with float experts / int8 experts
    python benchmarks/bench_int8_experts.py switch     # the CPU kernel against de-quantizing per hit expert

``forms``: bench_moe.py's Qwen3-30B-A3B-shaped random model, decode tok/s at batch 1 and 4 (64 random prompt tokens,
32 new, median of 3), each against float32 in the same run, with the weights' bytes and the share of greedy tokens
equal to float32's. ``switch``: one gate/up projection of Qwen3-30B-A3B's experts ([128, 1536, 2048], float32, 8
experts per token) for growing prompts: where ``Int8Experts`` stops using the CPU kernel.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

import hf_accel
from hf_accel import Int8Config, SpeculativeConfig
from hf_accel.kernels import portable
from hf_accel.kernels.ops import choose

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import build


def _median_ms(call) -> float:
    call()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def forms() -> None:
    _, tokenizer = hf_accel.load_default()
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(10, len(tokenizer), (b, 64), generator=gen) for b in (1, 4)}
    plain = dict(native=False, speculative=SpeculativeConfig(auto=None))
    kinds = {"float32": {}, "int8, experts in float": {"int8": Int8Config(skip_modules=("*experts",))},
             "int8 with int8 experts": {"int8": Int8Config()}}  # fmt: skip
    base: dict[int, tuple[float, torch.Tensor]] = {}
    for kind, options in kinds.items():
        model = hf_accel.patch_model(build("qwen3_moe", len(tokenizer), tokenizer), **plain, **options)
        mib = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
        row = [kind, f"{mib:.0f} MiB"]
        for batch, ids in prompts.items():
            kw = dict(do_sample=False, pad_token_id=0)
            full = _median_ms(
                lambda ids=ids, m=model, kw=kw: m.generate(ids, max_new_tokens=32, min_new_tokens=32, **kw)
            )
            first = _median_ms(lambda ids=ids, m=model, kw=kw: m.generate(ids, max_new_tokens=1, **kw))
            tps = batch * 31 / ((full - first) / 1e3)
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, **kw)[:, 64:]
            base.setdefault(batch, (tps, out))
            agree = (out == base[batch][1]).float().mean().item()
            row.append(f"batch {batch}: {tps:.1f} tok/s ({tps / base[batch][0]:.2f}x, tokens agree {agree:.2f})")
        print(" | ".join(row), flush=True)
        del model


def switch() -> None:
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (128, 1536, 2048), dtype=torch.int8)
    s = torch.rand(128, 1536, 1) / 50
    kernel = choose("int8_experts_linear", "cpu", group_size=2048)
    print(f"kernel: {kernel.impl}")
    for tokens in (16, 64, 128, 256, 512):
        x, ids = torch.randn(tokens, 2048), torch.rand(tokens, 128).topk(8, dim=-1).indices
        native = _median_ms(lambda x=x, ids=ids: kernel.fn(x, ids, q, s))
        dequantized = _median_ms(lambda x=x, ids=ids: portable.int8_experts_linear(x, ids, q, s))
        print(f"{tokens} tokens ({tokens * 8} pairs): kernel {native:.1f} ms, de-quantized {dequantized:.1f} ms")


if __name__ == "__main__":
    {"forms": forms, "switch": switch}[sys.argv[1] if len(sys.argv) > 1 else "forms"]()
