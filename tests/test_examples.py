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
