"""The optimum-quanto int8 backend (issue 33, item 4): layer equivalence, model level, unpatch, and its errors."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, random_batch, tiny_model
from torch import nn

import hf_accel
from hf_accel import IncompatibleOptionsError, Int8Config
from hf_accel.quant.apply import resolve_backend
from hf_accel.quant.quanto import is_quanto_linear, quanto_dequantize, to_quanto_linear

pytest.importorskip("optimum.quanto")  # a test dependency (pyproject [test])

QUANTO = Int8Config(backend="quanto", keep_original=True)
KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("rows", [1, 37])
def test_quanto_linear_matches_the_float_layer_with_its_dequantized_weight(rows):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    q = to_quanto_linear(linear)
    assert is_quanto_linear(q) and not is_quanto_linear(linear)
    reference = nn.Linear(256, 96)
    reference.weight.data = quanto_dequantize(q, torch.float32)
    reference.bias.data = linear.bias.data.clone()
    x = torch.randn(rows, 256)
    with torch.no_grad():
        got, expected, original = q(x), reference(x), linear(x)
    assert_close(got, expected, atol=1e-4, rtol=1e-4, name="quanto vs dequantized float layer")
    assert (got - original).abs().max() / original.abs().max() < 0.01  # per-row int8 rounding


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_a_quanto_model_generates_close_to_float_and_unpatches_exactly(arch):
    plain = tiny_model(arch)
    model = hf_accel.patch_model(tiny_model(arch), int8=QUANTO)
    swapped = [n for n, m in model.named_modules() if is_quanto_linear(m)]
    assert swapped and all(".layers." in n or n == "lm_head" for n in swapped)
    ids, mask = random_batch(2, [7, 4], seed=1)
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits
    assert ((got - want).norm() / want.norm()).item() < 0.05
    for extra in ({}, {"paged": True}, {"prompt_lookup": True}):
        assert model.generate(input_ids=ids, attention_mask=mask, **extra, **KW).shape == (2, 15)
    report = hf_accel.patch_report(model)["changes"]["int8"]
    assert report["backend quanto"] == 1 and report["Linear -> QLinear"] == len(swapped)
    hf_accel.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, want)  # keep_original: bitwise


def test_quanto_refusals_and_auto_choice(tmp_path):
    with pytest.raises(IncompatibleOptionsError, match="group_size must be None with backend='quanto'"):
        Int8Config(backend="quanto", group_size=32)
    with pytest.raises(IncompatibleOptionsError, match="activations must be 'float' with backend='quanto'"):
        Int8Config(backend="quanto", activations="int8")
    model = hf_accel.patch_model(tiny_model("llama"), int8=QUANTO)
    with pytest.raises(IncompatibleOptionsError, match="optimum-quanto"):
        model.save_pretrained(tmp_path)
    with pytest.raises(IncompatibleOptionsError, match="bitsandbytes / optimum-quanto layers"):
        hf_accel.save_quantized(model, tmp_path)
    fresh = tiny_model("llama")
    fresh.model.layers[0].mlp.down_proj = to_quanto_linear(fresh.model.layers[0].mlp.down_proj)
    with pytest.raises(IncompatibleOptionsError, match="quantized already"):
        hf_accel.patch_model(fresh, int8=QUANTO)
    assert resolve_backend(Int8Config(), torch.device("cpu")) == "native"  # the CPU's fastest
    assert resolve_backend(Int8Config(), torch.device("mps")) == "quanto"  # no native kernel there


def test_quanto_on_the_cpu_says_the_native_backend_is_faster(caplog):
    with caplog.at_level("WARNING", logger="hf_accel"):
        hf_accel.patch_model(tiny_model("llama"), int8=QUANTO)
    assert "optimum-quanto int8 on CPU decodes slower than fp32" in caplog.text
