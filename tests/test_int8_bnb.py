"""The bitsandbytes int8 backend: module equivalence, model level on every architecture, load_in_8bit models."""

import sys

import pytest
import torch
from helpers import assert_close, logits_of, random_batch, router_linears, tiny_model
from torch import nn

import hf_accel
from hf_accel import FeatureNotAvailableError, IncompatibleOptionsError, Int8Config
from hf_accel.quant.apply import resolve_backend
from hf_accel.quant.bnb import bnb_dequantize, is_bnb_linear, to_bnb_linear

bnb = pytest.importorskip("bitsandbytes")  # a test dependency (pyproject [test]); CI always has it

BNB = Int8Config(backend="bitsandbytes")


@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("rows", [1, 37])
def test_bnb_linear_matches_float_layer_with_dequantized_weight(threshold, rows):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=True)
    q = to_bnb_linear(linear, threshold)
    assert is_bnb_linear(q) and q.weight.dtype == torch.int8 and q.weight.shape == (96, 256)
    reference = nn.Linear(256, 96)
    reference.weight.data = bnb_dequantize(q, torch.float32)
    reference.bias.data = linear.bias.data.clone()
    x = torch.randn(rows, 256)
    x[:, 5] *= 20  # an outlier feature, above the LLM.int8() threshold
    with torch.no_grad():
        got, expected, original = q(x), reference(x), linear(x)
    assert got.dtype == torch.float32
    # the kernel, not the rounding: on CPU bitsandbytes computes with the de-quantized weight (measured 3e-7)
    assert_close(got, expected, atol=1e-5, rtol=1e-5, name="bnb vs dequantized float layer")
    # against the original weights: row-wise int8 rounding, measured 0.34-0.50% of the output range
    assert (got - original).abs().max() / original.abs().max() < 0.01


def test_bnb_dequantize_is_within_half_a_step_per_row():
    torch.manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    q = to_bnb_linear(linear, 6.0)
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127  # [N, 1]
    error = (bnb_dequantize(q, torch.float32) - linear.weight).abs()
    # round-to-nearest: half a quantization step, plus fp16 rounding (bitsandbytes quantizes an fp16 copy)
    assert bool((error <= step / 2 + linear.weight.abs() * 2**-11 + 1e-7).all())
    q(torch.randn(2, 64))  # bitsandbytes moves the scales into the layer's state on the first call
    assert torch.equal(bnb_dequantize(q, torch.float32), bnb_dequantize(to_bnb_linear(linear, 6.0), torch.float32))


def test_bnb_backend_every_architecture(tiny, arch):
    ids, mask = random_batch(3, [5, 9, 12])
    before = logits_of(tiny, ids, mask)
    hf_accel.patch_model(tiny, int8=BNB)
    routers = router_linears(tiny)  # MoE routers stay float
    linears = [m for m in tiny.modules() if type(m) is nn.Linear and not any(m is r for r in routers)]
    quantized = [m for m in tiny.modules() if is_bnb_linear(m)]
    # every decoder linear is bitsandbytes; only a tied LM head may stay float (embedding lookups need it)
    assert len(quantized) >= 2 * 4 and all(m is tiny.get_output_embeddings() for m in linears)
    counts = hf_accel.patch_report(tiny)["changes"]["int8"]
    assert counts["backend bitsandbytes"] == 1 and counts["Linear -> Linear8bitLt"] == len(quantized)
    after = logits_of(tiny, ids, mask)
    rel = ((after - before).norm() / before.norm()).item()
    # vs the original weights: quantization noise of a wide-init random model (native measured 0.3-5.2%)
    assert rel < 0.08, f"{arch}: relative logits error {rel:.4f}"
    out = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out.shape == (3, 12 + 6)
    hf_accel.unpatch_model(tiny)
    assert not any(is_bnb_linear(m) for m in tiny.modules())
    # unpatch leaves the de-quantized weights: the same model in float reproduces the bitsandbytes logits
    assert_close(logits_of(tiny, ids, mask), after, atol=1e-4, rtol=1e-4, name="bnb vs dequantized model")  # fp32


def test_bnb_keep_original_restores_bitwise():
    model = tiny_model("llama", tie_word_embeddings=False)
    ids, mask = random_batch(2)
    before = logits_of(model, ids, mask)
    hf_accel.patch_model(model, int8=Int8Config(backend="bitsandbytes", keep_original=True))
    assert is_bnb_linear(model.lm_head)  # an untied head is quantized too
    logits_of(model, ids, mask)
    hf_accel.unpatch_model(model)
    assert torch.equal(logits_of(model, ids, mask), before)


def test_bnb_tied_head_stays_float_and_says_so():
    model = tiny_model("llama", tie_word_embeddings=True)
    hf_accel.patch_model(model, int8=BNB)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    changes = hf_accel.patch_report(model)["changes"]["int8"]
    assert changes["tied lm_head left in float (bitsandbytes: embedding lookup stays float)"] == 1


def test_bnb_on_cpu_warns_about_speed(caplog):
    with caplog.at_level("WARNING", logger="hf_accel"):
        hf_accel.patch_model(tiny_model("llama"), int8=BNB)
    assert "bitsandbytes int8 on CPU de-quantizes its weights on every call" in caplog.text


def test_auto_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend(Int8Config(), cpu) == "native"  # the AVX2 kernel: ~3x fp32 here, bitsandbytes ~1x
    assert resolve_backend(Int8Config(), cuda) == "native"  # fused int8-weight matmuls (docs/cuda.md)
    assert resolve_backend(Int8Config(), torch.device("mps")) in ("quanto", "native")
    assert resolve_backend(Int8Config(group_size=32), cuda) == "native"  # bitsandbytes has row scales only
    assert resolve_backend(Int8Config(backend="native"), cuda) == "native"
    assert resolve_backend(BNB, cpu) == "bitsandbytes"


def test_bnb_errors(monkeypatch, tmp_path):
    with pytest.raises(
        IncompatibleOptionsError,
        match=r"Int8Config.group_size must be None with backend='bitsandbytes' \(row scales only\), got 32",
    ):
        Int8Config(backend="bitsandbytes", group_size=32)
    model = tiny_model("llama")
    hf_accel.patch_model(model, int8=BNB)
    with pytest.raises(IncompatibleOptionsError, match="save_quantized writes the native backend's format"):
        hf_accel.save_quantized(model, tmp_path / "q")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    other = tiny_model("llama")
    missing = r"needs the bitsandbytes package: pip install 'hf_accel\[bnb\]'"
    with pytest.raises(FeatureNotAvailableError, match=missing):
        hf_accel.patch_model(other, int8=BNB)
    assert not hf_accel.is_patched(other)


@pytest.fixture
def loaded_in_8bit(tmp_path):
    """A tiny llama saved and reloaded with Transformers' ``BitsAndBytesConfig(load_in_8bit=True)``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu")
    return model.eval()


@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
def test_load_in_8bit_model_is_patched_around(loaded_in_8bit):
    model = loaded_in_8bit
    bnb_layers = sum(is_bnb_linear(m) for m in model.modules())
    assert bnb_layers == 14  # 2 layers x 7 projections; Transformers leaves the LM head in float
    ids, mask = random_batch(3, [4, 8, 11])
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hf_accel.patch_model(model)  # lossless defaults around the bitsandbytes layers
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)  # paged cache + speculative hooks change nothing
    changes = hf_accel.patch_report(model)["changes"]
    assert changes["fused_mlp"] == {"MLP left unfused (projections are not nn.Linear)": 2}
    hf_accel.unpatch_model(model)
    # int8=True quantizes what is still float (the tied LM head, natively on CPU) and leaves the rest as loaded
    hf_accel.patch_model(model, int8=Int8Config(keep_original=True))
    changes = hf_accel.patch_report(model)["changes"]["int8"]
    assert changes["bitsandbytes layer left as loaded"] == bnb_layers
    assert changes["Linear -> Int8Linear"] == 1 and changes["tied embedding -> int8"] == 1
    hf_accel.unpatch_model(model)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False), expected)
