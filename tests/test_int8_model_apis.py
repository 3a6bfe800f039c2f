"""Transformers' model-level APIs on an int8-patched model: ``tie_weights``, ``num_parameters``,
``resize_token_embeddings``, and the warning when ``unpatch_model`` can only bring back de-quantized weights
(issue 33, item 6)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import tiny_model

import hf_accel
from hf_accel.core.errors import IncompatibleOptionsError

IDS = torch.tensor([[5, 6, 7, 8, 9]])
KW = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("gemma", True), ("qwen2", False)])
def test_num_parameters_and_tie_weights_behave_as_on_the_unpatched_model(arch, tied):
    plain = tiny_model(arch, tie_word_embeddings=tied)
    model = hf_accel.patch_model(tiny_model(arch, tie_word_embeddings=tied), int8=True)
    for exclude in (False, True):
        assert model.num_parameters(exclude_embeddings=exclude) == plain.num_parameters(exclude_embeddings=exclude)
    assert model.num_parameters(only_trainable=True) < plain.num_parameters(only_trainable=True)  # int8 is frozen
    before = model.generate(IDS, **KW)
    model.tie_weights()  # lm-evaluation-harness's HFLM calls it
    assert torch.equal(model.generate(IDS, **KW), before)
    hf_accel.unpatch_model(model)
    assert "num_parameters" not in model.__dict__ and "tie_weights" not in model.__dict__
    assert model.num_parameters() == plain.num_parameters()
    model.tie_weights()


def test_resize_token_embeddings_is_refused_with_what_to_do():
    model = hf_accel.patch_model(tiny_model("llama", tie_word_embeddings=True), int8=True)
    with pytest.raises(IncompatibleOptionsError, match=r"resize before patching, or hf_accel.unpatch_model"):
        model.resize_token_embeddings(300)
    hf_accel.unpatch_model(model)
    assert model.resize_token_embeddings(300).num_embeddings == 300


@pytest.mark.parametrize("keep", [False, True])
def test_unpatch_says_when_it_restores_de_quantized_weights(keep, caplog):
    model = hf_accel.patch_model(tiny_model("llama"), int8=hf_accel.Int8Config(keep_original=keep))
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        hf_accel.unpatch_model(model)
    warned = [r for r in caplog.records if "de-quantized weights" in r.getMessage()]
    assert len(warned) == (0 if keep else 1)
    if keep:
        assert torch.equal(model.generate(IDS, **KW), tiny_model("llama").generate(IDS, **KW))


def test_bitsandbytes_int8_refuses_save_pretrained_with_what_to_do(tmp_path):
    pytest.importorskip("bitsandbytes")
    model = hf_accel.patch_model(tiny_model("llama"), int8=hf_accel.Int8Config(backend="bitsandbytes"))
    with pytest.raises(IncompatibleOptionsError, match=r"hf_accel.save_quantized\(model, folder\)"):
        model.save_pretrained(tmp_path)
    assert not list(tmp_path.iterdir())
