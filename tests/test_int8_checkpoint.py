"""int8 checkpoints: save once, reload, identical outputs; clear errors for mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_batch, tiny_model

import hf_accel
from hf_accel import IncompatibleOptionsError, Int8Config, ModelNotFoundError, NotPatchedError


@pytest.mark.parametrize("group_size", [None, 16])
def test_save_then_load_gives_the_same_model(tmp_path, group_size):
    model = hf_accel.patch_model(
        tiny_model("llama"), int8=Int8Config(group_size=group_size, skip_modules=("*.o_proj",))
    )
    ids, mask = random_batch(2, [6, 9], seed=4)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    folder = hf_accel.save_quantized(model, tmp_path / "q")
    record = json.loads((folder / "hf_accel_int8.json").read_text())
    assert record["group_size"] == group_size and record["skip_modules"] == ["*.o_proj"]
    assert record["model_type"] == "llama" and "lm_head" in record["quantized"]
    assert "model.layers.0.self_attn.o_proj" not in record["quantized"]
    loaded = hf_accel.load_quantized(folder)
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, expected)  # same int8 tensors, same kernels: bitwise
    kwargs = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(loaded.generate(input_ids=ids, attention_mask=mask, **kwargs),
                       model.generate(input_ids=ids, attention_mask=mask, **kwargs))  # fmt: skip
    assert hf_accel.patch_report(loaded)["features"]["int8"]["group_size"] == group_size


def test_load_into_a_given_model_and_mismatches(tmp_path):
    model = hf_accel.patch_model(tiny_model("qwen2"), int8=True)
    folder = hf_accel.save_quantized(model, tmp_path / "q")
    target = tiny_model("qwen2", seed=9)
    hf_accel.load_quantized(folder, model=target)
    assert torch.equal(target.lm_head.qweight, model.lm_head.qweight)
    with pytest.raises(IncompatibleOptionsError) as info:
        hf_accel.load_quantized(folder, model=tiny_model("qwen2", hidden_size=32, head_dim=8))
    assert "does not match the given model's architecture (hidden_size: checkpoint 64 vs model 32)" in str(info.value)
    other = tiny_model("llama")
    with pytest.raises(IncompatibleOptionsError, match="model_type: checkpoint 'qwen2' vs model 'llama'"):
        hf_accel.load_quantized(folder, model=other)
    assert not hf_accel.is_patched(other)


def test_save_and_load_errors(tmp_path):
    with pytest.raises(NotPatchedError, match="save_quantized needs a model patched with int8"):
        hf_accel.save_quantized(hf_accel.patch_model(tiny_model("llama")), tmp_path / "x")
    with pytest.raises(ModelNotFoundError, match="is not an hf_accel int8 checkpoint"):
        hf_accel.load_quantized(tmp_path)


def _damaged(tmp_path, damage):
    model = hf_accel.patch_model(tiny_model("llama"), int8=True)
    folder = hf_accel.save_quantized(model, tmp_path / "q")
    damage(folder)
    return folder


def _edit_record(**fields):
    def damage(folder):
        path = folder / "hf_accel_int8.json"
        record = json.loads(path.read_text())
        for key, value in fields.items():
            if value is _DROP:
                record.pop(key)
            else:
                record[key] = value
        path.write_text(json.dumps(record))

    return damage


def _write(name, data):
    return lambda folder: (folder / name).write_bytes(data)


def _truncate(folder):
    path = folder / "model.int8.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bad_scale(value):
    def damage(folder):
        from safetensors.torch import load_file, save_file

        path = folder / "model.int8.safetensors"
        tensors = load_file(str(path))
        tensors["lm_head.scale"][0] = value
        save_file(tensors, str(path))

    return damage


_DROP = object()
DAMAGES = {
    "empty weights": (_write("model.int8.safetensors", b""), r"model.int8.safetensors cannot be read as safetensors"),
    "truncated weights": (_truncate, r"model.int8.safetensors cannot be read as safetensors"),
    "garbage weights": (_write("model.int8.safetensors", b"\x00\xffgarbage" * 64), "cannot be read as safetensors"),
    "bad json": (_write("hf_accel_int8.json", b"{not json"), r"hf_accel_int8.json is not valid JSON"),
    "a list": (_write("hf_accel_int8.json", b"[1, 2]"), r"hf_accel_int8.json must hold a JSON object, got list"),
    "missing key": (_edit_record(group_size=_DROP), r"field 'group_size' is missing"),
    "dtype 'load'": (_edit_record(dtype="load"), r"field 'dtype' is 'load'; one of \['bfloat16', 'float16'"),
    "skip not a list": (_edit_record(skip_modules="x"), r"field 'skip_modules' must be a list of strings"),
    "group size": (_edit_record(group_size=-3), r"field 'group_size' must be null or an int >= 1, got -3"),
    "activations": (_edit_record(activations="fp4"), r"field 'activations' is 'fp4'"),
    "nan scale": (_bad_scale(float("nan")), r"tensor 'lm_head.scale' holds NaN, infinite or negative scales"),
    "inf scale": (_bad_scale(float("inf")), r"tensor 'lm_head.scale' holds NaN"),
    "bad config": (_write("config.json", b"{]"), r"config.json cannot be read as a Transformers config"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_damaged_checkpoints_raise_one_typed_error_naming_the_file_and_field(tmp_path, case):
    damage, message = DAMAGES[case]
    folder = _damaged(tmp_path, damage)
    with pytest.raises(hf_accel.CheckpointError, match=message) as info:
        hf_accel.load_quantized(folder)
    assert isinstance(info.value, ValueError)
    target = tiny_model("llama")
    with pytest.raises(hf_accel.CheckpointError):
        hf_accel.load_quantized(folder, model=target)
    assert not hf_accel.is_patched(target)  # a given model is handed back as it came
