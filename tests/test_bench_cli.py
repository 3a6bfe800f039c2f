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


def test_bench_writes_table_json_markdown_and_plot(tiny_folder, tmp_path, capsys, caplog):
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
    # one timed run: no spread is claimed, and the run says why its figures are not to be quoted
    assert all(r["spread_pct"] is None for r in rows)
    assert "1 timed run(s) per cell: no spread is measured" in caplog.text
    gains = {r["technique"]: r["gain_from"] for r in rows}
    assert gains["baseline"] == "-" and gains["paged"].startswith("paged KV") and "lossy" in gains["int8"]
    assert "tokens/forward); target: " in gains["prompt-lookup"] and "tokens/forward" in gains["self-spec"]
    assert "| gain from |" in out


def test_speculative_rows_say_whether_speculation_or_the_executor_made_the_gain():
    none = bench._speculative_gain({"tokens_per_forward": 1.0, "target": "native executor (cpu/avx512)"})
    assert none == "none from speculation (1.00 tokens/forward); target: native executor (cpu/avx512)"
    some = bench._speculative_gain({"tokens_per_forward": 2.5, "target": "paged cache"})
    assert some == "speculation x2.50 (2.50 tokens/forward); target: paged cache"


def test_plot_has_a_title_value_labels_and_a_legend_clear_of_the_bars(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    seen = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (seen.append(fig), real(fig, *a, **k))[1])
    rows = [
        bench.BenchResult("baseline", 1, 10, 1, 100, 90, speedup=1.0, kv_mib=2.0),
        bench.BenchResult("native", 1, 8, 0.6, 160, 150, speedup=1.6, kv_mib=2.0),
    ]
    bench.plot(rows, tmp_path / "p.png", "model: m (llama, float32); 64 new tokens, median of 3, 2 threads")
    (fig,) = seen
    assert fig._suptitle.get_text().startswith("model: m (llama")
    labels = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert {"1.00", "1.60", "2.0"} <= set(labels)
    (legend,) = fig.legends  # below the charts, not over a chart's bars
    assert not any(ax.get_legend() for ax in fig.axes) and legend.get_texts()[0].get_text() == "batch 1"


def test_bench_all_skips_what_cannot_run_and_says_why(tiny_folder, capsys):
    argv = ["bench", "--model", str(tiny_folder), "--techniques", "all", "--batch", "1", "--max-new-tokens", "2"]
    assert main([*argv, "--repeats", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "compile: skipped" not in out and "| compile | 1 |" in out  # runs (tiny graphs compile quickly)
    assert "draft: skipped (needs --draft-model PATH)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--techniques", "turbo"], "unknown technique(s) turbo; choose from baseline, default, fused"),
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


def test_bench_argument_errors(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--batch", "1,x"])
    assert info.value.code == 2
    assert "--batch takes comma-separated integers, got '1,x'" in capsys.readouterr().err
    loads = []  # a missing prompts file is refused before the model loads
    monkeypatch.setattr("hf_accel.models.load_model", lambda *a, **k: loads.append(a))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--prompts", "/nonexistent/prompts.jsonl"])
    assert info.value.code == 2 and not loads
    assert "--prompts takes chat, grounded or a .jsonl file; '/nonexistent/prompts.jsonl' is neither" in (
        capsys.readouterr().err
    )
