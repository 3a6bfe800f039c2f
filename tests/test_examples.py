"""Examples must never rot: run each with tiny settings."""

import json
import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_run_generation_example(default_model, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["run_generation.py", "--max-new-tokens", "6", "--prompt", "Hi", "--no-stream"])
    runpy.run_path(str(EXAMPLES / "run_generation.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "hf_accel features: fused_mlp" in out
    assert "tokens/s]" in out


def test_paged_generation_example(default_model, monkeypatch, capsys):
    argv = ["paged_generation.py", "--max-new-tokens", "4", "--questions", "Hi", "Open on Sunday?", "Borrow?"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLES / "paged_generation.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("PagedCache(model_type='llama', layers=30,")
    assert out.count("Q: ") == 3
    # the second batch reuses the shared system prompt's full blocks (it is > 64 tokens long)
    reused = int(out.split("[batch of 2: ")[1].split(" s, ")[1].split(" prompt tokens")[0])
    assert reused >= 2 * 64


def _run(name: str, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_speculative_example(default_model, monkeypatch, capsys):
    _run("speculative_generation.py", ["--max-new-tokens", "12", "--num-tokens", "4"], monkeypatch)
    out = capsys.readouterr().out
    assert "identical: True]" in out and "tokens per target forward]" in out


def test_int8_example(default_model, monkeypatch, capsys, tmp_path):
    argv = ["--max-new-tokens", "4", "--output", str(tmp_path / "q"), "--activations", "int8"]  # W8A8
    _run("int8_quantize.py", argv, monkeypatch)
    out = capsys.readouterr().out
    assert f"saved to {tmp_path / 'q'}; reloaded in" in out and "perplexity: float" in out
    assert json.loads((tmp_path / "q" / "hf_accel_int8.json").read_text())["activations"] == "int8"


def test_all_features_example(default_model, monkeypatch, capsys):
    _run("all_features.py", ["--max-new-tokens", "6"], monkeypatch)
    out = capsys.readouterr().out
    assert "hf_accel features: int8, fused_mlp, paged, speculative" in out
    assert out.count("\n> ") == 3 and "[batch 3: " in out


def test_serve_requests_example(default_model, monkeypatch, capsys):
    _run("serve_requests.py", ["--max-new-tokens", "5", "--questions", "Hi", "Name a colour.", "Say yes."], monkeypatch)
    out = capsys.readouterr().out
    assert out.count("\nQ: ") == 3 and out.count("done: ") == 3
    assert "3 requests in " in out and "engine steps" in out


def test_compiled_generation_example(default_model, monkeypatch, capsys):
    _run("compiled_generation.py", ["--max-new-tokens", "6", "--batch", "2"], monkeypatch)
    out = capsys.readouterr().out
    assert "hf_accel features: fused_mlp, paged, speculative, compile" in out
    assert "identical: True]" in out and out.count("\n> ") == 2


def test_native_decoding_example(default_model, monkeypatch, capsys):
    _run("native_decoding.py", ["--max-new-tokens", "8", "--batch", "2", "--paged"], monkeypatch)
    out = capsys.readouterr().out
    assert "native executor: cpu/" in out and "identical: True]" in out and out.count("\n> ") == 2


def test_openai_server_example(default_model, monkeypatch, capsys):
    _run("openai_server.py", ["--max-tokens", "6"], monkeypatch)
    out = capsys.readouterr().out
    assert out.count("Q: ") == 3 and out.count("A: ") == 3 and "streamed: " in out
