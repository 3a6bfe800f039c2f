"""A patched model's ``state_dict`` / ``load_state_dict`` / ``save_pretrained`` are the unpatched model's: fused and
packed layers read and write the original keys, a weight update reaches every internal copy (and survives
unpatching), and int8 models save a plain checkpoint of their de-quantized weights."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

import hf_accel
from hf_accel.quant.model_apis import float_state_dict

IDS = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, 15]])
KW = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
LOSSLESS = {"default": {}, "compile": {"compile": True}, "native": {"native": True}}


@pytest.mark.parametrize("arch", ["llama", "phi3"])
@pytest.mark.parametrize("features", list(LOSSLESS))
def test_state_dict_has_the_unpatched_keys_and_values(arch, features):
    plain = tiny_model(arch)
    patched = hf_accel.patch_model(tiny_model(arch), **LOSSLESS[features])
    got, want = patched.state_dict(), plain.state_dict()
    assert list(sorted(got)) == list(sorted(want))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("features", list(LOSSLESS))
def test_save_pretrained_of_a_patched_model_reloads_into_the_same_model(features, tmp_path):
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"), **LOSSLESS[features])
    patched.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.generate(IDS, **KW), plain.generate(IDS, **KW))


@pytest.mark.parametrize("features", list(LOSSLESS))
def test_load_state_dict_updates_a_patched_model_and_survives_unpatch(features):
    other = tiny_model("llama", seed=9)
    patched = hf_accel.patch_model(tiny_model("llama"), **LOSSLESS[features])
    patched.load_state_dict(other.state_dict())  # strict: every key matched, none left over
    assert torch.equal(patched.generate(IDS, **KW), other.generate(IDS, **KW))
    hf_accel.unpatch_model(patched)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in patched.state_dict().items())
    assert torch.equal(patched.generate(IDS, **KW), other.generate(IDS, **KW))


def test_load_state_dict_reports_shape_mismatches_and_missing_keys():
    patched = hf_accel.patch_model(tiny_model("llama"), compile=True)
    state = tiny_model("llama").state_dict()
    bad = dict(state)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for model.layers.0.self_attn.q_proj.weight"):
        patched.load_state_dict(bad)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(RuntimeError, match="Missing key"):
        patched.load_state_dict(missing)


@pytest.mark.parametrize("tied", [True, False])
def test_int8_save_pretrained_writes_a_plain_checkpoint_of_the_de_quantized_weights(tmp_path, tied, caplog):
    patched = hf_accel.patch_model(tiny_model("llama", tie_word_embeddings=tied), int8=True)
    with caplog.at_level("WARNING", logger="hf_accel"):
        patched.save_pretrained(tmp_path)
    assert "writes its de-quantized float weights" in caplog.text
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # plain Transformers: every weight found, none random
    want = float_state_dict(patched)
    got = loaded.state_dict()
    assert sorted(got) == sorted(tiny_model("llama", tie_word_embeddings=tied).state_dict())
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    # the same model the int8 one computes, in float: its logits are the int8 model's within int8-kernel rounding
    torch.testing.assert_close(loaded(IDS).logits, patched(IDS).logits, rtol=1e-4, atol=1e-4)


def test_int8_unpatched_model_saves_as_a_normal_checkpoint(tmp_path):
    patched = hf_accel.patch_model(tiny_model("llama"), int8=True)
    hf_accel.unpatch_model(patched)
    patched.save_pretrained(tmp_path)  # de-quantized float weights: a normal checkpoint again
    assert AutoModelForCausalLM.from_pretrained(tmp_path).generate(IDS, **KW).shape == (2, 11)
