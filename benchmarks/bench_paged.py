#!/usr/bin/env python
"""Paged KV cache on the real model: memory utilisation, decode attention, end-to-end decode, prefix reuse.

    python benchmarks/bench_paged.py [--max-prompt 1500] [--new-tokens 64] [--only a b c d]

Every figure is a ratio against a baseline measured in this process:
(a) KV bytes holding live tokens / KV bytes reserved, batch of 8 prompts of 20..max-prompt tokens:
    PagedCache vs DynamicCache (padded) vs StaticCache;
(b) decode attention time per step at 1k and 4k context: the paged kernel (and the gather fallback) vs SDPA
    over a contiguous cache;
(c) end-to-end decode tokens/s of generate(paged=True) vs the default cache, batch 1 and batch 8 mixed lengths;
(d) time to first token of a request sharing a ~1,000-token system prompt with an earlier one, vs the first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import StoppingCriteriaList

import hf_accel
from hf_accel import PagedCache
from hf_accel.core.metrics import StepClock
from hf_accel.kernels.ops import choose

LICENSE = Path("/usr/share/common-licenses/GPL-3")  # real English text shipped with Debian


def english_text() -> str:
    if LICENSE.exists():
        return LICENSE.read_text()
    return " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the window."] * 400)


def prompt_ids(tok, n_tokens: int, offset: int = 0) -> list[int]:
    ids = tok(english_text(), add_special_tokens=False)["input_ids"]
    return ids[offset : offset + n_tokens]


def left_pad(rows: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def kv_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def bench_memory(model, tok, max_prompt: int) -> None:
    lengths = [round(20 + (max_prompt - 20) * i / 7) for i in range(8)]
    inputs = left_pad([prompt_ids(tok, n, 97 * i) for i, n in enumerate(lengths)], tok.pad_token_id)
    new = 16
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    cfg = model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    live = sum(n + new - 1 for n in lengths) * token_bytes  # the last token's K/V is never computed
    rows = []
    with torch.inference_mode():
        out = model.generate(**inputs, **kw, return_dict_in_generate=True)
        rows.append(("DynamicCache (padded)", kv_bytes(out.past_key_values)))
        out = model.generate(**inputs, **kw, cache_implementation="static", return_dict_in_generate=True)
        rows.append(("StaticCache", kv_bytes(out.past_key_values)))
        hf_accel.patch_model(model, fused_mlp=False)
        try:
            cache = PagedCache(model, max_memory=1 << 30)
            model.generate(**inputs, **kw, cache=cache)
        finally:
            hf_accel.unpatch_model(model)
        s = cache.stats()
        assert s["bytes_live"] == live, (s["bytes_live"], live)
        rows.append(("PagedCache (blocks in use)", s["blocks_used"] * cache.block_bytes))
    print(f"\n(a) KV memory, batch 8, prompt lengths {lengths}, {new} new tokens; live K/V = {live / 2**20:.1f} MiB")
    print("| cache | KV bytes held (MiB) | live / held |")
    print("|---|---|---|")
    for name, held in rows:
        print(f"| {name} | {held / 2**20:.1f} | {live / held:.3f} |")
    print(f"PagedCache pool reserved (whole pool, mostly untouched pages): {s['bytes_reserved'] / 2**20:.0f} MiB")


def bench_attention() -> None:
    choice = choose("paged_attention", "cpu", dtype=torch.float32, block_size=16, head_dim=64)
    k = choice if choice.native else None
    print(f"\n(b) decode attention per step (SmolLM2 geometry: 9 heads, 3 KV heads, dim 64; block 16); {choice.impl}")
    print("| batch | context | SDPA contiguous (us) | paged kernel (us) | kernel / SDPA | gather fallback / SDPA |")
    print("|---|---|---|---|---|---|")
    heads, kv_heads, dim, bs = 9, 3, 64, 16

    def timed(fn, n: int = 30) -> float:
        for _ in range(3):
            fn()
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1e6

    for batch in (1, 8):
        for ctx in (1024, 4096):
            nb = batch * ctx // bs
            kp, vp = torch.randn(nb, bs, kv_heads, dim), torch.randn(nb, bs, kv_heads, dim)
            tables = torch.randperm(nb).to(torch.int32).view(batch, -1)
            q = torch.randn(batch, heads, 1, dim)
            pos = torch.full((batch, 1), ctx - 1, dtype=torch.int32)
            kc, vc = torch.randn(batch, kv_heads, ctx, dim), torch.randn(batch, kv_heads, ctx, dim)
            scale = 1 / math.sqrt(dim)
            t_sdpa = timed(
                lambda q=q, kc=kc, vc=vc, sc=scale: F.scaled_dot_product_attention(q, kc, vc, scale=sc, enable_gqa=True)
            )
            t_kernel = (
                timed(lambda q=q, kp=kp, vp=vp, t=tables, p=pos, sc=scale: k.fn(q, kp, vp, t, p, sc, 0, 0.0))
                if k is not None
                else float("nan")
            )
            flat = tables.long()

            def gather(q=q, kp=kp, vp=vp, flat=flat, scale=scale):
                kk = kp[flat].flatten(1, 2).transpose(1, 2)  # [B, H_kv, S, D]
                vv = vp[flat].flatten(1, 2).transpose(1, 2)
                return F.scaled_dot_product_attention(q, kk, vv, scale=scale, enable_gqa=True)

            t_gather = timed(gather)
            ratios = f"{t_kernel / t_sdpa:.2f}x | {t_gather / t_sdpa:.2f}x"
            print(f"| {batch} | {ctx} | {t_sdpa:.0f} | {t_kernel:.0f} | {ratios} |")


def chat(tok, prompts: list[str]) -> dict[str, torch.Tensor]:
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    return tok(texts, return_tensors="pt", padding=True)


def run_decode(model, inputs, new: int, **extra) -> tuple[float, float, torch.Tensor]:
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([clock]),
            **extra,
        )
    stamps, batch = clock.stamps, inputs["input_ids"].shape[0]
    rate = batch * (len(stamps) - 1) / (stamps[-1] - stamps[0])  # one stamp per decoding step
    return rate, stamps[0] - clock.start, out


def bench_decode(model, tok, new: int, repeats: int) -> None:
    questions = [
        "Write a short story about a robot who learns to paint.",
        "Explain how a refrigerator works, step by step, for a curious ten year old who loves machines.",
        "List five facts about the Moon.",
        "Why is the sky blue?",
        "Summarise the plot of Romeo and Juliet in one paragraph, then name its main themes.",
        "Give me a recipe for pancakes.",
        "What are the benefits of regular exercise for the heart, the lungs and the mind?",
        "Describe the water cycle.",
    ]
    print(f"\n(c) end-to-end decode, {new} new tokens, median of {repeats}")
    print("| batch | default cache tok/s | paged tok/s | paged / default | greedy identical |")
    print("|---|---|---|---|---|")
    for batch in (1, 8):
        inputs = chat(tok, questions[:batch])
        run_decode(model, inputs, 4)  # warm-up
        cache = None
        base, paged = [], []
        for _ in range(repeats):  # interleaved, so drift of the machine hits both alike
            base.append(run_decode(model, inputs, new))  # unpatched model, default cache
            hf_accel.patch_model(model, fused_mlp=False)  # the paged cache alone
            try:
                if cache is None:
                    cache = PagedCache(model, max_memory=256 << 20, prefix_cache=False)
                    run_decode(model, inputs, 4, cache=cache)
                paged.append(run_decode(model, inputs, new, cache=cache))
            finally:
                hf_accel.unpatch_model(model)
        r_base = statistics.median(r for r, _, _ in base)
        r_paged = statistics.median(r for r, _, _ in paged)
        same = torch.equal(base[0][2], paged[0][2])
        print(f"| {batch} | {r_base:.1f} | {r_paged:.1f} | {r_paged / r_base:.2f}x | {'yes' if same else 'NO'} |")


def bench_prefix(model, tok, system_tokens: int) -> None:
    system = tok.decode(prompt_ids(tok, system_tokens, 0))
    questions = ["What does this text say about copying?", "Who may modify the program?", "Summarise it."]

    def request(q: str) -> dict[str, torch.Tensor]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tok(text, return_tensors="pt")

    print(f"\n(d) time to first token with a shared {system_tokens}-token system prompt")
    print("| request | prompt tokens | default cache TTFT (s) | paged + prefix cache TTFT (s) | first paged / this |")
    print("|---|---|---|---|---|")
    hf_accel.patch_model(model, fused_mlp=False)
    try:
        cache = PagedCache(model, max_memory=256 << 20, prefix_cache=True)
        first = None
        for i, q in enumerate(questions):
            inputs = request(q)
            unpatched_like = run_decode(model, inputs, 2)[1]  # no cache= -> base attention, default cache
            _, ttft, _ = run_decode(model, inputs, 2, cache=cache)
            first = first or ttft
            n = inputs["input_ids"].shape[1]
            print(f"| {i + 1} | {n} | {unpatched_like:.3f} | {ttft:.3f} | {first / ttft:.1f}x |")
        print(f"prefix hits: {cache.stats()['prefix_hit_tokens']} of {cache.stats()['prompt_tokens']} prompt tokens")
    finally:
        hf_accel.unpatch_model(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-prompt", type=int, default=1500, help="longest prompt of the memory test (a)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per request in (c)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--only", nargs="+", choices=["a", "b", "c", "d"], default=["a", "b", "c", "d"])
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, tok = hf_accel.load_default(torch.float32)
    tok.padding_side = "left"
    if "a" in args.only:
        bench_memory(model, tok, args.max_prompt)
    if "b" in args.only:
        bench_attention()
    if "c" in args.only:
        bench_decode(model, tok, args.new_tokens, args.repeats)
    if "d" in args.only:
        bench_prefix(model, tok, args.system_tokens)


if __name__ == "__main__":
    main()
