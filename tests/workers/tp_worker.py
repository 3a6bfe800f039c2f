"""Run under ``torchrun --nproc-per-node 2`` by tests/test_scaling.py: hf_accel on a tensor-parallel tiny model.

Args (argv): the saved tiny model folder, then the folder to write ``rank<r>.json`` results into. Every check
compares against the same model loaded in this process without tensor parallelism.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import hf_accel


def main() -> None:
    folder, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    tp = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
    rank = dist.get_rank()
    single = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 11, 12, 13]])
    results: dict[str, object] = {}

    def record(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # reported to the test, which names it
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}

    def greedy(model, **kw):
        return model.generate(ids, max_new_tokens=12, do_sample=False, **kw)[0].tolist()

    with torch.no_grad():
        before = tp(ids).logits
    hf_accel.patch_model(single)
    hf_accel.patch_model(tp)
    ref = greedy(single)
    record("report", lambda: hf_accel.patch_report(tp)["changes"])
    record("plain", lambda: greedy(tp) == ref)
    record("paged", lambda: greedy(tp, paged=True) == ref)
    record("prompt_lookup", lambda: greedy(tp, prompt_lookup=True) == ref)
    record(
        "engine",
        lambda: (
            tp.generate_many([ids[0].tolist()], max_new_tokens=12, eos_token_id=None)[0].tolist()
            == single.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0].tolist()
        ),
    )
    record("self_spec", lambda: greedy(tp, speculative=hf_accel.speculative.SelfSpeculative()))
    hf_accel.unpatch_model(tp)
    hf_accel.unpatch_model(single)
    with torch.no_grad():
        record("unpatch_bitwise", lambda: bool(torch.equal(tp(ids).logits, before)))

    # the LM head is gathered ("colwise_gather_output"), left in float under tensor parallelism: skip it in both
    int8 = hf_accel.Int8Config(skip_modules=("lm_head",))
    hf_accel.patch_model(single, int8=int8)
    hf_accel.patch_model(tp, int8=int8)
    with torch.no_grad():
        diff = (tp(ids).logits - single(ids).logits).abs().max().item()
    record("int8_logits_max_abs_diff", lambda: diff)
    record("int8_greedy", lambda: greedy(tp) == greedy(single))
    record("int8_report", lambda: hf_accel.patch_report(tp)["changes"]["int8"])
    hf_accel.unpatch_model(tp)
    record("compile", lambda: hf_accel.patch_model(tp, compile=True) and "patched")

    # a plan the fused MLP cannot honour (gathered gate/up outputs): a typed error, and fused_mlp=False works
    config = AutoConfig.from_pretrained(folder)
    config.base_model_tp_plan = {
        **config.base_model_tp_plan,
        "layers.*.mlp.gate_proj": "colwise_gather_output",
        "layers.*.mlp.up_proj": "colwise_gather_output",
        "layers.*.mlp.down_proj": "rowwise_split_input",
    }
    gathered = AutoModelForCausalLM.from_pretrained(folder, config=config, tp_plan="auto").eval()
    record("gathered_plan", lambda: hf_accel.patch_model(gathered) and "patched")
    hf_accel.patch_model(gathered, fused_mlp=False)
    record("gathered_plan_unfused", lambda: greedy(gathered) == ref)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
