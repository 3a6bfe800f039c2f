#!/usr/bin/env python
"""Speculative generation on the real model: tokens/s of each strategy vs plain generate, same run.

    python benchmarks/bench_speculative.py [--new-tokens 128] [--batch 1 4] [--tasks grounded chat] [--compile]

Tasks: ``grounded`` (rewrite a given ~400-token passage: the answer copies much of the prompt) and ``chat``
(free-form questions). Strategies: hf_accel's prompt lookup and int8 self-speculation, and at batch 1
Transformers' own ``prompt_lookup_num_tokens=10`` and ``assistant_model`` (a copy of the model). Greedy
throughout: every output is checked token-identical to plain generate. "tokens/s" counts generated tokens
(not padding) over the whole call, prefill included; "decode tok/s" leaves the prefill out: the time of the same
call with ``max_new_tokens=1`` (its prefill and first token, identical for every method) is subtracted, and so
is that first token; medians of ``--repeats``, taken round-robin over the methods (after a full-length warm-up
of each) so that the machine's drift spreads over all of them. Ratios are against "plain generate"
(Transformers' cache); compare a ``+ paged`` row with "plain generate + paged" (the paged cache without
speculation, with ``--compile`` its compiled decode step) for the gain of speculation alone.

``--native`` patches with ``native=True`` as well (docs/native.md): "plain generate" is then plain decoding through
the native executor, so every ratio is speculation's own gain on the same executor; a first row "plain generate,
model forward" (a copy patched without it) gives the executor's own gain.

``--compile`` patches with ``compile=True`` as well (pre-packed linears, docs/compile.md): "plain generate" is
then the packed model without speculation, and a first row "plain generate, unpatched" gives the ratio against
the user's original model; Transformers' methods are skipped (they bypass the packed linears). Self-speculation's
draft is an int8 copy of the model either way (the copy unpacks the linears before quantizing them), so there its
rows measure what speculation adds to a packed target.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

import hf_accel
from hf_accel.speculative import Composite, PromptLookup, SelfSpeculative

LICENSE = Path("/usr/share/common-licenses/GPL-3")
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
]


def passages(tok, count: int, tokens: int = 400) -> list[str]:
    text = LICENSE.read_text() if LICENSE.exists() else "The quick brown fox jumps over the lazy dog. " * 2000
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return [tok.decode(ids[2000 + i * tokens : 2000 + (i + 1) * tokens]) for i in range(count)]


def build_inputs(tok, task: str, batch: int) -> dict[str, torch.Tensor]:
    if task == "grounded":
        instruction = "Fix the punctuation of the following passage and write it out again in full"
        prompts = [f"{instruction}:\n\n{p}" for p in passages(tok, batch)]
    else:
        prompts = CHAT[:batch]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return tok(texts, return_tensors="pt", padding=True)


def run(model, inputs, new: int, **kwargs) -> tuple[float, torch.Tensor, dict | None, float]:
    """One greedy call: (tokens/s over the whole call, sequences, speculative stats, decode tokens/s)."""
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False, **kwargs)
        first = time.perf_counter() - start  # prefill + the first token
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, **kwargs)
        elapsed = time.perf_counter() - start
    tail = out.sequences[:, inputs["input_ids"].shape[1] :]
    produced = int((tail != model.generation_config.pad_token_id).sum())
    rows = tail.shape[0]
    return produced / elapsed, out.sequences, getattr(out, "speculative", None), (produced - rows) / (elapsed - first)


def plain_row(model, inputs, args) -> tuple[float, torch.Tensor, None, float]:
    """A reference row: ``model``'s plain generate, warmed up, median of ``args.repeats``."""
    run(model, inputs, 4)
    samples = [run(model, inputs, args.new_tokens) for _ in range(args.repeats)]
    return statistics.median(x[0] for x in samples), samples[0][1], None, statistics.median(x[3] for x in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tasks", nargs="+", choices=["grounded", "chat"], default=["grounded", "chat"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also patch with compile=True (packed linears)")
    parser.add_argument("--native", action="store_true", help="also patch with native=True (the native executor)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tok = hf_accel.load_default(torch.float32)
    tok.padding_side = "left"
    assistant = copy.deepcopy(model)
    forward_only = hf_accel.patch_model(copy.deepcopy(model), compile=args.compile) if args.native else None
    compile_cfg = hf_accel.CompileConfig(prepack=False) if args.compile and args.native else args.compile
    hf_accel.patch_model(model, compile=compile_cfg, native=args.native)
    self_spec = SelfSpeculative("int8")
    combo = Composite(PromptLookup(num_tokens=10), self_spec)
    print(
        "| task | batch | method | tokens/s | vs plain | decode tok/s | decode vs plain | identical | acceptance "
        "| tokens/forward |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for task in args.tasks:
        for batch in args.batch:
            inputs = build_inputs(tok, task, batch)
            methods: dict[str, dict] = {
                "plain generate": {},
                "plain generate + paged": {"paged": True},
                "hf_accel prompt lookup": {"speculative": PromptLookup(num_tokens=10)},
                "hf_accel prompt lookup + paged": {"speculative": PromptLookup(num_tokens=10), "paged": True},
                "hf_accel prompt lookup k=16 + paged": {"speculative": PromptLookup(num_tokens=16), "paged": True},
                "hf_accel self-spec (int8 copy)": {"speculative": self_spec},
                "hf_accel self-spec + paged": {"speculative": self_spec, "paged": True},
                "hf_accel prompt lookup, else self-spec": {"speculative": combo, "paged": True},
            }
            if batch == 1 and not args.compile:
                methods["Transformers prompt_lookup_num_tokens=10"] = {"prompt_lookup_num_tokens": 10}
                methods["Transformers assistant_model (copy)"] = {"assistant_model": assistant}
            results = {}
            if forward_only is not None:
                results["plain generate, model forward"] = plain_row(forward_only, inputs, args)
            if args.compile:
                results["plain generate, unpatched"] = plain_row(assistant, inputs, args)
            run(model, inputs, 4)  # warm-up
            for kwargs in methods.values():
                # a full-length warm-up: with --compile, chunk widths and batch sizes first met mid-call compile
                # their graphs (seconds each) here rather than in a timed call
                run(model, inputs, args.new_tokens, **kwargs)
            # repeats round-robin over the methods: this machine's speed drifts over minutes, and a baseline
            # measured minutes before a method skews their ratio (by up to ~20% in earlier runs)
            samples: dict[str, list] = {name: [] for name in methods}
            for _ in range(args.repeats):
                for name, kwargs in methods.items():
                    samples[name].append(run(model, inputs, args.new_tokens, **kwargs))
            for name, got in samples.items():
                rate = statistics.median(s[0] for s in got)
                results[name] = (rate, got[0][1], got[0][2], statistics.median(s[3] for s in got))
            base_rate, base_out, _, base_decode = results["plain generate"]
            first_rate, _, _, first_decode = next(iter(results.values()))
            for name, (rate, out, stats, decode) in results.items():
                same = "yes" if torch.equal(out, base_out) else "NO"
                acc = f"{stats['acceptance_rate']:.2f}" if stats else "-"
                tpf = f"{stats['tokens_per_forward']:.2f}" if stats else "-"
                first_name = "model forward" if args.native else "unpatched"
                extra = args.compile or args.native
                vs = f"{rate / base_rate:.2f}x" + (f" ({rate / first_rate:.2f}x {first_name})" if extra else "")
                vs_decode = f"{decode / base_decode:.2f}x" + (
                    f" ({decode / first_decode:.2f}x {first_name})" if extra else ""
                )
                print(
                    f"| {task} | {batch} | {name} | {rate:.1f} | {vs} | {decode:.1f} | {vs_decode} | {same} | {acc} "
                    f"| {tpf} |"
                )


if __name__ == "__main__":
    main()
