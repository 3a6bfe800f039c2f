"""``hf-accel bench`` end to end on a tiny local model, and its user errors."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import tiny_model

from hf_accel import bench
from hf_accel.cli import main


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    words = sorted({w for p in bench.CHAT_PROMPTS for w in p.replace(".", " ").replace("?", " ").split()})
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words[:250])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>").save_pretrained(folder)
    tiny_model("llama").save_pretrained(folder)
    return folder


def test_bench_writes_table_json_markdown_and_plot(tiny_folder, tmp_path, capsys):
    argv = [
        "bench", "--model", str(tiny_folder), "--techniques", "fused,paged,int8,w8a8,prompt-lookup,self-spec",
        "--batch", "1,2", "--max-new-tokens", "4", "--repeats", "1", "--no-progress",
        "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"), "--plot", str(tmp_path / "r.png"),
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["technique"], r["batch"]) for r in rows] == [
        (t, b) for t in ("baseline", "fused", "paged", "int8", "w8a8", "prompt-lookup", "self-spec") for b in (1, 2)
    ]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0
        if r["technique"] in ("fused", "paged", "prompt-lookup", "self-spec"):
            assert r["identical"] == "yes", r  # lossless techniques reproduce the baseline's greedy tokens
    assert rows[6]["ppl_delta_pct"] is not None  # int8 is lossy: its perplexity change is reported
    assert rows[8]["technique"] == "w8a8" and rows[8]["ppl_delta_pct"] is not None
    assert (tmp_path / "r.md").read_text() in out
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_all_skips_what_cannot_run_and_says_why(tiny_folder, capsys):
    argv = ["bench", "--model", str(tiny_folder), "--techniques", "all", "--batch", "1", "--max-new-tokens", "2"]
    assert main([*argv, "--repeats", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "compile: skipped" not in out and "| compile | 1 |" in out  # runs (tiny graphs compile quickly)
    assert "draft: skipped (needs --draft-model PATH)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--techniques", "turbo"], "unknown technique(s) turbo; choose from baseline, fused"),
        (["--techniques", "draft"], "technique 'draft' cannot run here: needs --draft-model PATH"),
        (["--json", "/nonexistent/dir/r.json"], "--json '/nonexistent/dir/r.json' cannot be written"),
        (["--model", "/nonexistent/model"], "is not a local model folder (no config.json there)"),
    ],
)
def test_bench_user_errors_exit_2_without_traceback(args, message, capsys):
    assert main(["bench", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-accel: error: ") and message in err and "Traceback" not in err


def test_bench_bnb_without_bitsandbytes_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if it were not installed
    assert main(["bench", "--no-progress", "--techniques", "bnb"]) == 2
    err = capsys.readouterr().err
    assert "technique 'bnb' cannot run here: int8 backend 'bitsandbytes' needs the bitsandbytes package" in err
    assert "pip install 'hf_accel[bnb]'" in err


def test_bench_argument_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--batch", "1,x"])
    assert info.value.code == 2
    assert "--batch takes comma-separated integers, got '1,x'" in capsys.readouterr().err
