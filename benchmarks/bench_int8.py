#!/usr/bin/env python
"""Decode speed of weight-only int8 vs fp32 and bf16 plain generate on the real model, same run.

    python benchmarks/bench_int8.py [--max-new-tokens 128] [--batch 1 8]

Prints decode tokens/s (aggregate over the batch), ratios against fp32 and bf16 measured in this process,
greedy agreement with fp32, and the bytes held by the linear layers' weights.
"""

from __future__ import annotations

import argparse
import copy

import torch

import hf_accel
from hf_accel.bench import CHAT_PROMPTS
from hf_accel.quant import Int8Linear

PROMPTS = CHAT_PROMPTS


def decode_rate(model, inputs, new_tokens: int) -> tuple[float, torch.Tensor]:
    from hf_accel.metrics import TimingStreamer

    batch = inputs["input_ids"].shape[0]
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)  # warm-up
        if batch == 1:
            streamer = TimingStreamer()
            out = model.generate(
                **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=streamer
            )
            return streamer.timing().decode_tokens_per_s, out
        import time

        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return batch * (new_tokens - 1) / (time.perf_counter() - start - prefill), out


def linear_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.quantized.nbytes()
        elif type(m) is torch.nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    model, tok = hf_accel.load_default()
    tok.padding_side = "left"
    variants = {
        "fp32": model,
        "bf16": copy.deepcopy(model).to(torch.bfloat16),
        "int8 (hf_accel)": hf_accel.patch_model(copy.deepcopy(model), int8=True, fused_mlp=False),
    }
    print("| batch | variant | decode tok/s | vs fp32 | vs bf16 | greedy = fp32 | linear weights MB |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in PROMPTS[:batch]
        ]
        inputs = tok(texts, return_tensors="pt", padding=True)
        rates, outs = {}, {}
        for name, m in variants.items():
            rates[name], outs[name] = decode_rate(m, inputs, args.max_new_tokens)
        n = inputs["input_ids"].shape[1]
        for name, m in variants.items():
            same = (outs[name][:, n:] == outs["fp32"][:, n:]).float().mean().item()
            print(
                f"| {batch} | {name} | {rates[name]:.1f} | {rates[name] / rates['fp32']:.2f}x | "
                f"{rates[name] / rates['bf16']:.2f}x | {same:.0%} of tokens | {linear_bytes(m) / 1e6:.0f} |"
            )


if __name__ == "__main__":
    main()
