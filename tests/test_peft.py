"""PEFT adapters and a patched model: adapters added before patching run exactly (the features leave adapter-wrapped
projections alone); patching the PEFT wrapper, or an adapter added after patching that targets projections the fused
MLPs replaced, is a typed error that says what to do, never an adapter silently left out."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PAD, random_batch, tiny_model

import hf_accel
from hf_accel import IncompatibleOptionsError, UnsupportedModelError

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KW = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)


def _adapted(model, targets, seed: int = 1):
    """``model`` with a LoRA adapter of random (non-zero) weights on ``targets``."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(model, config).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_adapter_added_before_patching_runs_exactly(arch):
    base = tiny_model(arch)
    ids, mask = random_batch(2, [7, 11], seed=2)
    adapted = _adapted(copy.deepcopy(base), ALL)
    expected = adapted.generate(input_ids=ids, attention_mask=mask, **KW)
    assert not torch.equal(expected, base.generate(input_ids=ids, attention_mask=mask, **KW))  # the adapter counts
    inner = hf_accel.patch_model(adapted.get_base_model())
    report = hf_accel.patch_report(inner)
    assert report["changes"]["fused_mlp"] == {"MLP left unfused (projections are not nn.Linear)": 2}, report
    for extra in ({}, {"paged": True}, {"prompt_lookup": True}, {"paged": True, "prompt_lookup": True}):
        got = adapted.generate(input_ids=ids, attention_mask=mask, **KW, **extra)
        assert torch.equal(got, expected), extra
    hf_accel.unpatch_model(inner)
    assert torch.equal(adapted.generate(input_ids=ids, attention_mask=mask, **KW), expected)
    merged = hf_accel.patch_model(adapted.merge_and_unload())  # merged: a plain model, every feature applies
    assert torch.equal(merged.generate(input_ids=ids, attention_mask=mask, **KW), expected)


@pytest.mark.parametrize(
    "features",
    [{"int8": True}, {"compile": hf_accel.CompileConfig(backend="eager", mlp=True)}],
    ids=["int8", "compile"],
)
def test_int8_and_packing_leave_the_adapters_linears_alone(features):
    """int8 and the compile feature's packed linears swap plain ``nn.Linear`` modules: never the base layer or the
    LoRA matrices of an adapter-wrapped projection (PEFT reads their weights), only the projections it left."""
    base = tiny_model("llama")
    ids, mask = random_batch(2, [7, 11], seed=2)
    adapted = _adapted(copy.deepcopy(base), ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    expected = adapted.generate(input_ids=ids, attention_mask=mask, **KW)
    inner = hf_accel.patch_model(adapted.get_base_model(), **features)
    if "int8" in features:  # what the adapter left is int8 now
        assert type(inner.model.layers[0].self_attn.k_proj).__name__ == "Int8Linear"
    for name, module in inner.named_modules():
        if name.endswith(("lora_A.default", "lora_B.default", "base_layer")):
            assert type(module) is torch.nn.Linear, name
    got = adapted.generate(input_ids=ids, attention_mask=mask, **KW)
    assert torch.equal(got, expected)  # int8 as well: these weights' greedy tokens do not move


def test_patching_the_peft_wrapper_says_what_to_patch():
    adapted = _adapted(tiny_model("llama"), ["q_proj"])
    with pytest.raises(UnsupportedModelError, match=r"patch_model\(model\.get_base_model\(\)\).*merge_and_unload"):
        hf_accel.patch_model(adapted)


def test_an_adapter_added_after_patching_must_not_miss_the_fused_projections():
    """Fused MLPs replace gate_proj / up_proj with one gate_up_proj: PEFT does not find them, so an adapter naming
    them (with others it does find) would silently lose those weights. The call is refused; an adapter on the
    attention projections only runs exactly."""
    base = tiny_model("llama")
    ids, mask = random_batch(2, [7, 11], seed=2)
    patched = hf_accel.patch_model(copy.deepcopy(base))
    patched.generate(input_ids=ids, attention_mask=mask, **KW)
    adapted = _adapted(patched, ALL)
    with pytest.raises(IncompatibleOptionsError, match="targets gate_proj, up_proj, which fused_mlp replaced"):
        adapted.generate(input_ids=ids, attention_mask=mask, **KW)
    # the recipe the error gives: remove the adapter, unpatch, add it again, patch the adapted model's causal LM
    expected = _adapted(copy.deepcopy(base), ALL).generate(input_ids=ids, attention_mask=mask, **KW)
    model = adapted.unload()
    hf_accel.unpatch_model(model)
    again = _adapted(model, ALL)
    hf_accel.patch_model(again.get_base_model())
    assert torch.equal(again.generate(input_ids=ids, attention_mask=mask, **KW), expected)
    regex = _adapted(hf_accel.patch_model(copy.deepcopy(base)), r".*\.(q_proj|up_proj)")
    with pytest.raises(IncompatibleOptionsError, match="targets up_proj, which"):
        regex.generate(input_ids=ids, attention_mask=mask, **KW)
    attention = ["q_proj", "v_proj"]
    expected = _adapted(copy.deepcopy(base), attention).generate(input_ids=ids, attention_mask=mask, **KW)
    patched = hf_accel.patch_model(copy.deepcopy(base))
    patched.generate(input_ids=ids, attention_mask=mask, **KW)  # the executor was built before the adapter came
    got = _adapted(patched, attention).generate(input_ids=ids, attention_mask=mask, **KW)
    assert torch.equal(got, expected)
