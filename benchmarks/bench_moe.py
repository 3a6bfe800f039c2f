#!/usr/bin/env python
"""hf_accel on a mixture-of-experts model: decode speed of each technique against plain ``generate``, one process.

    python benchmarks/bench_moe.py [--arch qwen3_moe] [--techniques baseline,default,paged,...] [--batch 1 4]

No MoE checkpoint travels with the repository, so the model is a seeded random one shaped like a scaled-down
Qwen3-30B-A3B (``--arch qwen3_moe``; ``mixtral``, ``gpt_oss`` and the other MoE entries of the registry take the same
counts): hidden 1024, 8 layers, 16 query / 4 K/V heads of 64, 32 experts of 512 with 4 per token, SmolLM2's tokenizer
and vocabulary, ``initializer_range`` 0.02, float32 (about 2.1 GB). Random weights choose experts about uniformly, as
trained routers roughly do, but what prompt lookup accepts on random text says nothing: the speculative rows' own
figure is the cost of one k-token verification against a one-token step (``--step-costs``), printed first: a MoE
verification reads up to k times as many experts as a one-token step.

Rows come from ``hf_accel.bench.run_bench`` (``hf-accel bench``'s own measuring: a warm-up call, then the median of
``--repeats`` calls; ratios against the baseline measured in the same run; greedy tokens compared with it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_accel
from hf_accel.bench import markdown_table, parse_techniques, run_bench

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,  # a dense layer's, where the architecture has any
    moe_intermediate_size=512,
    num_experts=32,
    num_local_experts=32,
    n_routed_experts=32,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
    initializer_range=0.02,
    tie_word_embeddings=False,
)
#: per-architecture names for the same counts (GPT-OSS calls its experts' size ``intermediate_size``; its layers
#: alternate a 128-token sliding window and full attention, each with attention sinks, as GPT-OSS-20B's do)
ARCH_SHAPE = {"gpt_oss": dict(intermediate_size=512, sliding_window=128)}


def build(arch: str, vocab: int, tokenizer) -> torch.nn.Module:
    """The seeded random MoE model (float32, eval mode)."""
    config = AutoConfig.for_model(arch, vocab_size=vocab, **{**SHAPE, **ARCH_SHAPE.get(arch, {})})
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@torch.inference_mode()
def step_costs(model: torch.nn.Module, context: int = 128, chunks: tuple[int, ...] = (1, 2, 4, 8)) -> str:
    """Milliseconds of one forward of ``k`` new tokens after a ``context``-token prompt (Transformers' cache, plain
    model), median of 5: what a k-token verification costs against a one-token step."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, model.config.vocab_size, (1, context + max(chunks)), generator=gen)
    rows, base = [], None
    for k in chunks:
        times = []
        for _ in range(6):
            out = model(input_ids=ids[:, :context], use_cache=True)
            start = time.perf_counter()
            model(input_ids=ids[:, context : context + k], past_key_values=out.past_key_values, use_cache=True)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[1:]) * 1000
        base = base or ms
        rows.append(f"| {k} | {ms:.1f} | {ms / base:.2f}x |")
    return "\n".join(["| new tokens | ms per forward | vs 1 token |", "|---|---|---|", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--techniques", default="baseline,default,paged,compile,int8,prompt-lookup,self-spec")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-step-costs", action="store_true")
    args = parser.parse_args()
    _, tokenizer = hf_accel.load_default()
    model = build(args.arch, len(tokenizer), tokenizer)
    techniques, notes = parse_techniques(args.techniques, has_draft=False)
    print(f"{args.arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"threads {torch.get_num_threads()}, cpu {torch.backends.cpu.get_cpu_capability()}, "
          f"experts implementation {model.config._experts_implementation}", flush=True)  # fmt: skip
    if not args.no_step_costs:
        print(step_costs(model), flush=True)
    results = run_bench(model, tokenizer, techniques, args.batch, max_new_tokens=args.max_new_tokens,
                        repeats=args.repeats, progress=False)  # fmt: skip
    print(markdown_table(results))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
