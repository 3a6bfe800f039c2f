#!/usr/bin/env python
"""How much of a decode step the RMSNorms take (is a fused norm worth building?), real model.

    python benchmarks/bench_norm.py [--repeats 100]

Times every RMSNorm module of the model (input, post-attention and final norms) once per "step" on a
``[1, 1, H]`` input, and a whole batch-1 decode step of ``compile=True`` (pre-packed linears) for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_accel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    model, tok = hf_accel.load_default(torch.float32)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.inference_mode():
        for norm in norms:
            norm(x)
        start = time.perf_counter()
        for _ in range(args.repeats):
            for norm in norms:
                norm(x)
        norm_ms = (time.perf_counter() - start) / args.repeats * 1e3
        hf_accel.patch_model(model, compile=True)
        inputs = tok.apply_chat_template(
            [{"role": "user", "content": "Tell me about Paris."}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        model.generate(**inputs, max_new_tokens=4, do_sample=False)
        model.generate(**inputs, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        step_ms = hf_accel.last_stats(model).tpot_mean_s * 1e3
    print(
        f"{len(norms)} RMSNorms per step: {norm_ms:.2f} ms; packed batch-1 decode step {step_ms:.1f} ms "
        f"({100 * norm_ms / step_ms:.0f}%)"
    )


if __name__ == "__main__":
    main()
