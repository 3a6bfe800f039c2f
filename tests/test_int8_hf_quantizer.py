"""Loading int8 the Transformers way (issue 33, item 2): ``from_pretrained(quantization_config=hf_accel.Int8Config())``
quantizes while loading and gives the model ``patch_model(model, int8=True)`` gives; ``save_pretrained`` writes int8
with ``quantization_config`` in config.json and ``from_pretrained`` reloads it; registration only on request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import ARCHS, random_batch, router_linears, tiny_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.quantizers import auto as hf_auto

import hf_accel
from hf_accel.core.errors import CheckpointError, IncompatibleOptionsError
from hf_accel.quant.hf_quantizer import Int8QuantizationConfig, Int8Quantize
from hf_accel.quant.linear import Int8Embedding, Int8Linear

KW = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def registered():
    hf_accel.register_quantizer()
    yield
    hf_accel.unregister_quantizer()


def _saved(tmp_path, arch="llama", **overrides):
    folder = tmp_path / "float"
    tiny_model(arch, **overrides).save_pretrained(folder)
    return folder


def _int8_reference(folder, **load):
    """The float checkpoint loaded plainly, then patched with int8: what the quantizer must equal."""
    return hf_accel.patch_model(AutoModelForCausalLM.from_pretrained(folder, **load).eval(), int8=True)


def _same_model(a, b, ids, mask):
    assert torch.equal(a(input_ids=ids, attention_mask=mask).logits, b(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(a.generate(input_ids=ids, attention_mask=mask, **KW), b.generate(ids, attention_mask=mask, **KW))


#: where a checkpoint keeps layer 0's o_proj when Transformers saves it under the architecture's original names
#: (EXAONE 3.5 loads into Llama's classes and is renamed back on save; int8 tensors follow the renaming)
_SAVED_O_PROJ = {"exaone": "transformer.h.0.attn.attention.out_proj"}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_while_loading_equals_patching_and_reloads_as_int8(tmp_path, arch, tied):
    folder = _saved(tmp_path, arch, tie_word_embeddings=tied)
    ids, mask = random_batch(2, [4, 7])
    want = _int8_reference(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config()).eval()
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.get_input_embeddings(), Int8Embedding) == tied
    routers = router_linears(model)  # MoE routers stay float
    left = [m for m in model.model.layers.modules() if type(m) is torch.nn.Linear]
    assert all(any(m is r for r in routers) for m in left)
    _same_model(model, want, ids, mask)

    saved = tmp_path / "int8"
    model.save_pretrained(saved)
    record = json.loads((saved / "config.json").read_text())["quantization_config"]
    assert record == {
        "quant_method": "hf_accel_int8",
        "format": 1,
        "backend": "native",
        "group_size": None,
        "skip_modules": [],
        "activations": "float",
    }
    o_proj = _SAVED_O_PROJ.get(arch, "model.layers.0.self_attn.o_proj")
    with safe_open(saved / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor(f"{o_proj}.qweight").dtype == torch.int8
    assert f"{o_proj}.weight" not in keys and "lm_head.qweight" in keys
    reloaded = AutoModelForCausalLM.from_pretrained(saved).eval()  # no quantization_config argument
    assert isinstance(reloaded.config.quantization_config, Int8QuantizationConfig)
    _same_model(reloaded, want, ids, mask)


def test_weights_are_quantized_one_tensor_at_a_time_as_they_load(tmp_path, monkeypatch):
    folder = _saved(tmp_path, "qwen3")
    seen = []
    convert = Int8Quantize.convert

    def spy(self, input_dict, full_layer_name=None, **kwargs):
        seen.append(full_layer_name)
        return convert(self, input_dict, full_layer_name=full_layer_name, **kwargs)

    monkeypatch.setattr(Int8Quantize, "convert", spy)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config())
    linears = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    assert sorted(seen) == sorted(linears) and len(seen) == 2 * 7 + 1  # 7 per layer + the (untied) head
    assert all("weight" not in m._parameters for m in model.modules() if isinstance(m, Int8Linear))


@pytest.mark.parametrize(
    "options",
    [
        hf_accel.Int8Config(group_size=16),
        hf_accel.Int8Config(activations="int8"),
        hf_accel.Int8Config(skip_modules=("lm_head", "*.mlp.down_proj")),
    ],
    ids=["group16", "w8a8", "skip"],
)
def test_options_load_and_round_trip_like_the_patch(tmp_path, options):
    folder = _saved(tmp_path, "llama", initializer_range=0.02)  # Transformers' default range: close logits
    ids, mask = random_batch(3, [3, 8, 5], seed=1)
    want = hf_accel.patch_model(AutoModelForCausalLM.from_pretrained(folder).eval(), int8=options)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=options).eval()
    _same_model(model, want, ids, mask)
    if options.skip_modules:
        assert type(model.lm_head) is torch.nn.Linear and type(model.model.layers[1].mlp.down_proj) is torch.nn.Linear
    model.save_pretrained(tmp_path / "int8")
    _same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "int8").eval(), want, ids, mask)


def test_bfloat16_loads_keep_float32_scales(tmp_path):
    folder = _saved(tmp_path, "llama", tie_word_embeddings=True)
    ids, mask = random_batch(2, [4, 6])
    want = _int8_reference(folder, dtype=torch.bfloat16)
    options = hf_accel.Int8Config()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=options)
    assert model.model.layers[0].self_attn.q_proj.scale.dtype == torch.float32
    _same_model(model.eval(), want, ids, mask)
    model.save_pretrained(tmp_path / "int8")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "int8", dtype=torch.bfloat16).eval()
    assert reloaded.lm_head.scale.dtype == torch.float32
    _same_model(reloaded, want, ids, mask)


def test_hf_accel_features_patch_on_top_and_model_apis_work(tmp_path):
    folder = _saved(tmp_path, "llama", tie_word_embeddings=True)
    ids, mask = random_batch(2, [4, 9], seed=2)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    want = hf_accel.patch_model(AutoModelForCausalLM.from_pretrained(folder).eval(), int8=True, native=True)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config()).eval()
    assert model.num_parameters() == plain.num_parameters()
    model.tie_weights()  # lm-evaluation-harness calls it
    with pytest.raises(IncompatibleOptionsError, match="load the float checkpoint, resize, then quantize"):
        model.resize_token_embeddings(300)
    with pytest.raises(IncompatibleOptionsError, match="already holds Int8Linear layers"):
        hf_accel.patch_model(model, int8=True)
    hf_accel.patch_model(model, native=True)
    assert torch.equal(model.generate(ids, attention_mask=mask, **KW), want.generate(ids, attention_mask=mask, **KW))
    paged = model.generate(ids, attention_mask=mask, paged=True, **KW)
    assert torch.equal(paged, want.generate(ids, attention_mask=mask, **KW))
    hf_accel.unpatch_model(model)
    assert isinstance(model.lm_head, Int8Linear)  # the loaded model is int8 itself: unpatch keeps it so


def test_registration_is_explicit_idempotent_and_undone(tmp_path):
    hf_accel.unregister_quantizer()
    before = (dict(hf_auto.AUTO_QUANTIZER_MAPPING), dict(hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING))
    assert not hf_accel.is_quantizer_registered()
    with pytest.raises(ValueError, match="hf_accel_int8"):  # Transformers' own error names the method
        AutoModelForCausalLM.from_pretrained(_saved(tmp_path), quantization_config=hf_accel.Int8Config())
    hf_accel.register_quantizer()
    hf_accel.register_quantizer()
    assert hf_accel.is_quantizer_registered()
    hf_accel.unregister_quantizer()
    assert (dict(hf_auto.AUTO_QUANTIZER_MAPPING), dict(hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING)) == before
    hf_accel.unregister_quantizer()  # a no-op


def test_importing_hf_accel_registers_nothing():
    code = (
        "import hf_accel\nfrom transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M\n"
        "assert 'hf_accel_int8' not in M\nhf_accel.patch_model\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_bad_options_and_records_get_typed_errors(tmp_path):
    folder = _saved(tmp_path)
    with pytest.raises(IncompatibleOptionsError, match=r"transformers.BitsAndBytesConfig\(load_in_8bit=True\)"):
        AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config(backend="bitsandbytes"))
    with pytest.raises(IncompatibleOptionsError, match=r"QuantoConfig"):
        AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config(backend="quanto"))
    with pytest.raises(IncompatibleOptionsError, match=r"keep_original=True\) has no meaning while loading"):
        AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config(keep_original=True))
    with pytest.raises(IncompatibleOptionsError, match="cannot be offloaded to disk"):
        AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=hf_accel.Int8Config(), device_map={"": "disk"}, offload_folder=tmp_path / "o"
        )
    AutoModelForCausalLM.from_pretrained(folder, quantization_config=hf_accel.Int8Config()).save_pretrained(
        tmp_path / "int8"
    )
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    config["quantization_config"]["format"] = 2
    (tmp_path / "int8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="this hf_accel reads format 1; upgrade hf_accel"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
    with pytest.raises(IncompatibleOptionsError, match="group_size"):
        Int8QuantizationConfig(group_size=0)
