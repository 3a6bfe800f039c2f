"""Tier (c) on tiny models of every registry architecture, plus tier (a) patch-state errors."""

import pytest
import torch
from helpers import ARCHS, EOS, assert_close, logits_of, random_batch, tiny_model
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_accel
from hf_accel import (
    AlreadyPatchedError,
    FeatureNotAvailableError,
    FusedGatedMLP,
    IncompatibleOptionsError,
    NotPatchedError,
    UnsupportedModelError,
)
from hf_accel.core.registry import resolve

SUPPORTED = ", ".join(hf_accel.supported_model_types())


def test_registry_covers_the_required_architectures():
    required = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "olmo2", "granite"}
    assert required <= set(ARCHS)


def test_patch_unpatch_every_architecture(tiny, arch):
    ids, mask = random_batch(3, [5, 12, 9], seed=1)
    before = logits_of(tiny, ids, mask)
    params_before = {n: p for n, p in tiny.named_parameters()}
    modules_before = dict(tiny.named_modules())
    dense = 2 - len(resolve(tiny).moe_layers)  # a mixture of experts stays as it is

    hf_accel.patch_model(tiny)
    assert hf_accel.is_patched(tiny)
    mlps = [m for m in tiny.modules() if isinstance(m, FusedGatedMLP)]
    assert len(mlps) == dense, arch
    patched = logits_of(tiny, ids, mask)
    # fused gate/up is the same maths in one matmul; fp32 rounding may differ in the last bits
    assert_close(patched, before, atol=1e-5, rtol=1e-4, name=f"{arch} patched logits")

    hf_accel.unpatch_model(tiny)
    assert not hf_accel.is_patched(tiny)
    assert torch.equal(logits_of(tiny, ids, mask), before), f"{arch}: logits after unpatch are not bitwise equal"
    assert dict(tiny.named_modules()) == modules_before  # the very same module objects
    after = dict(tiny.named_parameters())
    assert after.keys() == params_before.keys()
    assert all(after[n] is params_before[n] for n in after)  # the same Parameter objects
    assert "generate" not in tiny.__dict__
    assert type(tiny).generate is tiny.generate.__func__


def test_greedy_identical_every_architecture(tiny, arch):
    ids, mask = random_batch(3, [4, 11, 7], seed=2)
    expected = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    hf_accel.patch_model(tiny)
    got = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, expected), arch


def test_fused_weights_are_shared_not_copied():
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    hf_accel.patch_model(model)
    fused = model.model.layers[0].mlp
    base = fused.gate_up_weight.data_ptr()
    assert gate.data_ptr() == base
    assert up.data_ptr() == base + gate.numel() * gate.element_size()
    hf_accel.unpatch_model(model)
    assert gate.data_ptr() != base  # unpatched parameters own private storage again
    assert model.model.layers[0].mlp is mlp


def test_phi3_shares_its_existing_gate_up_parameter():
    model = tiny_model("phi3")
    original = model.model.layers[0].mlp.gate_up_proj.weight
    hf_accel.patch_model(model)
    assert model.model.layers[0].mlp.gate_up_weight is original


def test_patch_report_counts_changes():
    model = hf_accel.patch_model(tiny_model("qwen3"))
    report = hf_accel.patch_report(model)
    assert report["model_type"] == "qwen3"
    assert report["features"] == {
        "fused_mlp": {"eager": False},
        "paged": {"block_size": 16, "num_blocks": None, "max_memory": None, "prefix_cache": False, "attention": "auto"},
        "speculative": {
            "strategy": "prompt_lookup",
            "num_tokens": None,
            "adaptive": None,
            "max_ngram": 3,
            "auto": "self",
        },
        "native": {"prompts": True, "half_precision": False, "exact_codes": True},  # the CPU default (Llama)
    }
    assert report["implementations"]["default"]["configuration"]["uses"] == (
        "native executor + automatic self-speculation of greedy calls"
    )
    assert report["changes"]["paged"] == {
        "hf_accel_paged:sdpa registered with Transformers": 1,
        "attention sdpa -> hf_accel_paged:sdpa": 1,
        "generate_many bound": 1,
    }
    assert report["changes"]["fused_mlp"] == {"gate_proj weight shared": 2, "up_proj weight shared": 2, "MLP fused": 2}
    assert report["changes"]["core"] == {"generate wrapped": 1, "patch state attached": 1}


def test_patch_with_no_features_still_wraps_generate():
    model = hf_accel.patch_model(tiny_model("llama"), fused_mlp=False, paged=False, speculative=False, native=False)
    assert hf_accel.patch_report(model)["features"] == {}
    assert model.config._attn_implementation == "sdpa"
    assert "generate" in model.__dict__
    assert not any(isinstance(m, FusedGatedMLP) for m in model.modules())


def test_patch_twice_is_an_error():
    model = hf_accel.patch_model(tiny_model("llama"))
    with pytest.raises(AlreadyPatchedError) as info:
        hf_accel.patch_model(model)
    assert str(info.value) == (
        "LlamaForCausalLM is already patched by hf_accel; call hf_accel.unpatch_model(model) first"
    )


def test_unpatch_unpatched_is_an_error():
    model = tiny_model("llama")
    with pytest.raises(NotPatchedError) as info:
        hf_accel.unpatch_model(model)
    assert str(info.value) == "LlamaForCausalLM is not patched by hf_accel; nothing to unpatch"
    with pytest.raises(NotPatchedError):
        hf_accel.patch_report(model)


def test_repatch_after_unpatch():
    model = tiny_model("mistral")
    ids, _ = random_batch(1, [6])
    before = logits_of(model, ids)
    for _ in range(2):
        hf_accel.patch_model(model)
        hf_accel.unpatch_model(model)
    assert torch.equal(logits_of(model, ids), before)


def test_unknown_architecture():
    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError) as info:
        hf_accel.patch_model(model)
    assert str(info.value) == f"model_type 'gpt2' is not supported by hf_accel. Supported model types: {SUPPORTED}."
    assert isinstance(info.value, TypeError)
    assert not hf_accel.is_patched(model)


def test_not_a_causal_lm():
    base = AutoModel.from_config(tiny_model("llama").config)  # LlamaModel: no LM head, no generate
    with pytest.raises(UnsupportedModelError) as info:
        hf_accel.patch_model(base)
    assert str(info.value) == (
        "LlamaModel is not a Transformers causal language model (a PreTrainedModel with generate()). "
        f"Supported model types: {SUPPORTED}."
    )
    with pytest.raises(UnsupportedModelError) as info:
        hf_accel.patch_model(nn.Linear(2, 2))
    assert "Linear is not a Transformers causal language model" in str(info.value)


def test_structure_not_matching_the_spec():
    model = tiny_model("llama")
    del model.model.layers[1].mlp.up_proj
    with pytest.raises(UnsupportedModelError) as info:
        hf_accel.patch_model(model)
    assert str(info.value).startswith(
        "model_type 'llama' does not match hf_accel's spec: model.layers.1.mlp.up_proj is missing."
    )
    assert not hf_accel.is_patched(model)
    assert not isinstance(model.model.layers[0].mlp, FusedGatedMLP)  # nothing was half-patched


def test_unknown_feature_and_wrong_config_type():
    model = tiny_model("llama")
    with pytest.raises(IncompatibleOptionsError) as info:
        hf_accel.patch_model(model, fused=True)
    assert "unknown hf_accel feature 'fused'" in str(info.value)
    with pytest.raises(IncompatibleOptionsError) as info:
        hf_accel.patch_model(model, fused_mlp=hf_accel.PagedConfig())
    assert str(info.value) == "feature 'fused_mlp' takes a bool or a FusedMLPConfig, got PagedConfig"
    with pytest.raises(IncompatibleOptionsError) as info:
        hf_accel.patch_model(model, config={"paged": True})
    assert str(info.value) == "config must be an AccelConfig or None, got dict"
    assert not hf_accel.is_patched(model)


def test_feature_not_yet_available_is_a_clear_error(monkeypatch):
    from hf_accel import patch
    from hf_accel.core.state import Feature

    # every feature is implemented now: simulate a build without one, as a future feature starts out
    monkeypatch.setitem(patch.FEATURES, "compile", Feature(None, lossless=True))
    model = tiny_model("llama")
    with pytest.raises(FeatureNotAvailableError) as info:
        hf_accel.patch_model(model, compile=True)
    assert str(info.value) == (
        "feature 'compile' is not implemented in this version of hf_accel; "
        "available features: int8, fused_mlp, paged, speculative, native"
    )
    assert not hf_accel.is_patched(model)


def test_failed_patch_rolls_back(monkeypatch):
    model = tiny_model("llama")
    ids, _ = random_batch(1, [6])
    before = logits_of(model, ids)
    import hf_accel.patch as patch_mod

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(patch_mod, "bind_generate", boom)
    with pytest.raises(RuntimeError, match="boom"):
        hf_accel.patch_model(model)
    assert not hf_accel.is_patched(model)
    assert not any(isinstance(m, FusedGatedMLP) for m in model.modules())
    assert torch.equal(logits_of(model, ids), before)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_eos_and_batch_sizes(arch):
    model = tiny_model(arch)
    for batch in (1, 3, 8):
        ids, mask = random_batch(batch, seed=batch, max_len=20)
        kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        hf_accel.patch_model(model)
        got = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        hf_accel.unpatch_model(model)
        assert torch.equal(got, expected), (arch, batch)


def test_other_instances_and_classes_untouched():
    a, b = tiny_model("llama"), tiny_model("llama")
    cls_generate = type(a).__dict__.get("generate")
    hf_accel.patch_model(a)
    assert not hf_accel.is_patched(b)
    assert not isinstance(b.model.layers[0].mlp, FusedGatedMLP)
    assert type(a).__dict__.get("generate") is cls_generate
    assert "generate" not in b.__dict__


def test_patch_on_each_device(device):
    model = tiny_model("qwen2").to(device)
    ids, mask = (t.to(device) for t in random_batch(2, [6, 9]))
    before = logits_of(model, ids, mask)
    hf_accel.patch_model(model)
    fused = model.model.layers[0].mlp
    assert fused.gate_up_weight.device.type == device.type  # created where the original lived
    assert_close(logits_of(model, ids, mask), before, atol=1e-5, rtol=1e-4, name=f"{device} logits")  # fp32
    hf_accel.unpatch_model(model)
    assert torch.equal(logits_of(model, ids, mask), before)
