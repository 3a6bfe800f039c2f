"""Examples must never rot: run each with tiny settings."""

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
