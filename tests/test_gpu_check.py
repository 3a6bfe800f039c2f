"""benchmarks/gpu/check.sh's CPU-side parts: the same script and benchmark on a tiny model (``DEVICE=cpu``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_check_script_runs_its_cpu_side(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/check.sh")], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]["tiny"]
    assert [row for row in results if "error" in row] == []  # a failing path is a row with its error, not a crash
    paths = {(row["path"], row["batch"]) for row in results}
    for name in ("plain generate", "Transformers static + compile", "hf_accel paged", "hf_accel paged + compiled step",
                 "hf_accel int8 + compiled step"):  # fmt: skip
        assert (name, 1) in paths
    assert ("hf_accel Engine", 4) in paths and ("Transformers generate_batch", 4) in paths
    rows = {(row["path"], row["batch"]): row for row in results}
    for key in (("hf_accel paged", 1), ("hf_accel paged + compiled step", 4)):
        assert rows[key]["decode_tok_s"] > 0 and "vs_plain" in rows[key] and "same_tokens" in rows[key]
    assert 0 < rows[("hf_accel Engine", 4)]["kv_utilisation_mean"] <= 1
    verify = rows[("hf_accel paged + compiled step: verify 4 tokens / 1-token step", 1)]
    assert verify["step_ms"] > 0 and verify["verify_ms"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| hf_accel Engine | 4 |" in table and (tmp_path / "env.txt").read_text().startswith("torch ")


def test_a_stopped_benchmark_keeps_the_rows_it_measured(tmp_path):
    """check.sh's ``timeout`` sends SIGTERM: the rows of the shape being measured are written, exit status 124."""
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/bench_gpu.py"), "--device", "cpu", "--shapes", "tiny",
           "--new-tokens", "4", "--batch", "2", "--backend", "eager", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # the first measured row: plain generate at batch 1
            lines.append(line)
            if line.startswith("measured: "):
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 124, "".join(lines) + rest
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    rows = results["tiny (stopped by SIGTERM)"]
    assert rows and rows[0]["path"] == "plain generate" and rows[0]["decode_tok_s"] > 0 and "tokens" not in rows[0]
    assert "| plain generate | 1 |" in (tmp_path / "results.md").read_text()
