#!/usr/bin/env python
"""Decode speed of int8 backends vs fp32 and bf16 plain generate on the real model, same run.

    python benchmarks/bench_int8.py [--max-new-tokens 128] [--batch 1 8] [--skip-slow] [--stack] [--repeats 1]

Variants: fp32, bf16 weights, hf_accel int8 (native backend: weight-only, and W8A8 with
``Int8Config(activations="int8")``), hf_accel int8 through bitsandbytes
(``Int8Config(backend="bitsandbytes")``), and ``torch.ao`` dynamic qint8 (``--skip-slow`` drops bitsandbytes);
``--stack`` adds fp32 / int8 / W8A8 with the paged cache and the compiled decode step (``compile=True``).
Prints decode tokens/s (aggregate over the batch), ratios against fp32 and bf16 measured in this process,
greedy agreement with fp32, perplexity on a fixed English text, the bytes held by the linear layers' weights
and the resident memory each variant added when it was built (RSS delta, MB).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import warnings
from collections.abc import Callable

import torch

import hf_accel
from hf_accel.bench import load_prompts, perplexity
from hf_accel.fused.packed import PackedLinear
from hf_accel.quant import Int8Linear
from hf_accel.quant.bnb import is_bnb_linear


def decode_rate(model, inputs, new_tokens: int, **kwargs) -> tuple[float, torch.Tensor]:
    from hf_accel.core.metrics import TimingStreamer

    batch = inputs["input_ids"].shape[0]
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4, **kwargs)  # warm-up
        if batch == 1:
            streamer = TimingStreamer()
            out = model.generate(
                **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=streamer,
                **kwargs,
            )  # fmt: skip
            return streamer.timing().decode_tokens_per_s, out
        import time

        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=1, do_sample=False, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
        return batch * (new_tokens - 1) / (time.perf_counter() - start - prefill), out


def linear_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.quantized.nbytes()
        elif isinstance(m, PackedLinear):  # compile=True: the float weight pre-packed (same bytes)
            total += m.packed.numel() * m.packed.element_size()
        elif is_bnb_linear(m):
            total += m.weight.numel() + m.out_features * 4  # int8 values + fp32 row scales
        elif type(m) is torch.nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
    return total


def rss_bytes() -> int:
    """Current resident set of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return 0


def build(make: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, float]:
    """Build a variant and measure the resident memory it added (MB)."""
    gc.collect()
    before = rss_bytes()
    model = make()
    gc.collect()
    return model, (rss_bytes() - before) / 1e6


def torch_ao_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.ao`` dynamic int8 (weights and activations) of every ``nn.Linear``: the stock PyTorch route."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated in favour of torchao
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--skip-slow", action="store_true", help="leave out bitsandbytes (0.5x fp32 on CPU)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the variants; medians are printed")
    parser.add_argument("--stack", action="store_true", help="add variants with the paged cache + compiled step")
    args = parser.parse_args()
    model, tok = hf_accel.load_default()
    tok.padding_side = "left"
    plain = dict(fused_mlp=False, paged=False, speculative=False)
    makers = {
        "fp32": lambda: copy.deepcopy(model),
        "bf16": lambda: copy.deepcopy(model).to(torch.bfloat16),
        "int8 hf_accel native": lambda: hf_accel.patch_model(copy.deepcopy(model), int8=True, **plain),
        "int8 W8A8 hf_accel native": lambda: hf_accel.patch_model(
            copy.deepcopy(model), int8=hf_accel.Int8Config(activations="int8"), **plain
        ),
        "int8 hf_accel bitsandbytes": lambda: hf_accel.patch_model(
            copy.deepcopy(model), int8=hf_accel.Int8Config(backend="bitsandbytes"), **plain
        ),
        "torch.ao dynamic qint8": lambda: torch_ao_dynamic(copy.deepcopy(model)),
    }
    # the same with hf_accel's paged cache and compiled decode step (generate(paged=True)): fp32 shows what the
    # rest of the stack gives without int8
    stack = dict(fused_mlp=False, speculative=False, compile=True)
    stacked = {
        "fp32 + paged + compiled step": lambda: hf_accel.patch_model(copy.deepcopy(model), **stack),
        "int8 native + paged + compiled step": lambda: hf_accel.patch_model(copy.deepcopy(model), int8=True, **stack),
        "int8 W8A8 + paged + compiled step": lambda: hf_accel.patch_model(
            copy.deepcopy(model), int8=hf_accel.Int8Config(activations="int8"), **stack
        ),
    }
    if args.stack:
        makers.update(stacked)
    if args.skip_slow:
        del makers["int8 hf_accel bitsandbytes"]
    variants, rss = {}, {}
    for name, make in makers.items():
        variants[name], rss[name] = build(make)
    ppl = {name: perplexity(m, tok) for name, m in variants.items()}
    print(
        "| batch | variant | decode tok/s | vs fp32 | vs bf16 | greedy = fp32 | perplexity | linear weights MB "
        "| RSS added MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batch:
        inputs = tok(load_prompts("chat", tok, batch), return_tensors="pt", padding=True)
        runs: dict[str, list[float]] = {name: [] for name in variants}
        outs = {}
        for _ in range(args.repeats):  # rounds over all variants: slow drifts of the machine hit them alike
            for name, m in variants.items():
                kwargs = {"paged": True} if name in stacked else {}
                rate, outs[name] = decode_rate(m, inputs, args.max_new_tokens, **kwargs)
                runs[name].append(rate)
        rates = {name: statistics.median(r) for name, r in runs.items()}
        n = inputs["input_ids"].shape[1]
        for name, m in variants.items():
            same = (outs[name][:, n:] == outs["fp32"][:, n:]).float().mean().item()
            print(
                f"| {batch} | {name} | {rates[name]:.1f} | {rates[name] / rates['fp32']:.2f}x | "
                f"{rates[name] / rates['bf16']:.2f}x | {same:.0%} of tokens | {ppl[name]:.3f} | "
                f"{linear_bytes(m) / 1e6:.0f} | {rss[name]:.0f} |"
            )


if __name__ == "__main__":
    main()
