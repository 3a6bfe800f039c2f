#!/usr/bin/env python
"""Continuous batching (hf_accel.Engine) on the real model: total throughput and latency vs three baselines.

    python benchmarks/bench_engine.py [--requests 32] [--min-prompt 20] [--max-prompt 1000]
                                      [--min-new 16] [--max-new 256] [--max-running 32] [--skip-hf] [--compile]
                                      [--native]

Workload: ``--requests`` requests, prompt lengths spread evenly over ``min..max-prompt`` tokens (slices of a real
English text), output lengths over ``min..max-new`` tokens (EOS disabled, so every method generates exactly the
requested tokens), in shuffled order, all submitted at once. Methods, in this one process:

(a) padded-batch ``generate`` in batches of 8 (arrival order): a batch runs until its longest request is done;
(b) Transformers' continuous batching (``init_continuous_batching`` manager, per-request ``max_new_tokens``);
(c) sequential ``generate``, one request at a time;
(d) ``hf_accel.Engine`` on the patched model (with ``--compile`` / ``--native``, also on a ``compile=True`` /
    ``native=True`` patch).

Throughput counts only the requested output tokens. Latency: time to first token and time per output token
(p50/p90 over requests; for (a) and (c) a request's clock starts when the whole workload is submitted, like (b)
and (d)). Greedy outputs of (d) are compared with (c).
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

import hf_accel
from hf_accel import Engine, PagedConfig

LICENSE = Path("/usr/share/common-licenses/GPL-3")


def workload(tok, args) -> list[tuple[list[int], int]]:
    text = LICENSE.read_text() if LICENSE.exists() else "The quick brown fox jumps over the lazy dog. " * 2000
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = args.requests
    rng = random.Random(0)
    lens = [round(args.min_prompt + (args.max_prompt - args.min_prompt) * i / max(1, n - 1)) for i in range(n)]
    news = [round(args.min_new + (args.max_new - args.min_new) * i / max(1, n - 1)) for i in range(n)]
    rng.shuffle(lens)
    rng.shuffle(news)
    starts = [rng.randrange(0, len(ids) - args.max_prompt) for _ in range(n)]
    return [(ids[s : s + p], m) for s, p, m in zip(starts, lens, news, strict=True)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(name: str, wall: float, useful: int, ttft: list[float], tpot: list[float]) -> dict:
    return {
        "method": name,
        "wall_s": wall,
        "tok_s": useful / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "tpot_p50": pct(tpot, 0.5),
        "tpot_p90": pct(tpot, 0.9),
    }


class FirstToken:
    """A streamer that records when the first generated token of each row arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_padded(model, tok, work, batch: int = 8) -> tuple[dict, list[list[int]]]:
    tok.padding_side = "left"
    t0 = time.perf_counter()
    ttft, tpot = [], []
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), tok.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        streamer = FirstToken()
        new = max(n for _, n in chunk)
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=streamer
            )
        done = time.perf_counter()
        for _ in chunk:  # the rows of a batch share their first token time and their step time
            ttft.append(streamer.first - t0)
            tpot.append((done - streamer.first) / max(1, new - 1))
    wall = time.perf_counter() - t0
    return summary("padded generate, batches of 8", wall, sum(n for _, n in work), ttft, tpot), []


def run_sequential(model, work) -> tuple[dict, list[list[int]]]:
    t0 = time.perf_counter()
    ttft, tpot, outs = [], [], []
    for p, n in work:
        streamer = FirstToken()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer
            )
        done = time.perf_counter()
        outs.append(out[0, len(p) :].tolist())
        ttft.append(streamer.first - t0)
        tpot.append((done - streamer.first) / max(1, n - 1))
    wall = time.perf_counter() - t0
    return summary("sequential generate", wall, sum(n for _, n in work), ttft, tpot), outs


def run_hf_cb(model, work) -> dict:
    cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in work))
    t0 = time.perf_counter()
    done: dict[str, float] = {}
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        rids = [manager.add_request(p, max_new_tokens=n) for p, n in work]
        while len(done) < len(rids):
            result = manager.get_result(timeout=1)
            if result is None:
                continue
            if result.is_finished():
                done[result.request_id] = time.perf_counter()
    wall = time.perf_counter() - t0
    news = dict(zip(rids, [n for _, n in work], strict=True))
    row = summary("Transformers continuous batching", wall, sum(news.values()), [0.0], [0.0])
    # its results arrive when a request finishes (not streamed): no first-token time to report
    row.update(ttft_p50=None, ttft_p90=None, tpot_p50=None, tpot_p90=None)
    return row


def run_engine(model, work, args) -> tuple[dict, list[list[int]], Engine]:
    engine = Engine(
        model,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        paged=PagedConfig(block_size=16, max_memory=2 << 30, prefix_cache=True),
    )
    t0 = time.perf_counter()
    rids = [engine.add_request(p, max_new_tokens=n, min_new_tokens=n, do_sample=False) for p, n in work]
    outputs = engine.run_until_done()
    wall = time.perf_counter() - t0
    outs = [outputs[r].tokens for r in rids]
    ttft = [outputs[r].time_to_first_token for r in rids]
    tpot = [
        (outputs[r].latency - outputs[r].time_to_first_token) / max(1, n - 1)
        for r, (_, n) in zip(rids, work, strict=True)
    ]
    return summary("hf_accel Engine", wall, sum(n for _, n in work), ttft, tpot), outs, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=1000)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true", help="skip Transformers' continuous batching")
    parser.add_argument("--skip-sequential", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also run the Engine on a compile=True patch")
    parser.add_argument("--native", action="store_true", help="also run the Engine on a native=True patch")
    args = parser.parse_args()

    model, tok = hf_accel.load_default(torch.float32)
    work = workload(tok, args)
    print(
        f"{len(work)} requests: prompts {min(len(p) for p, _ in work)}..{max(len(p) for p, _ in work)} tokens, "
        f"outputs {min(n for _, n in work)}..{max(n for _, n in work)} ({sum(n for _, n in work)} tokens in all); "
        f"torch threads {torch.get_num_threads()}"
    )
    rows = []
    baseline_model = copy.deepcopy(model)
    row, _ = run_padded(baseline_model, tok, work)
    rows.append(row)
    print(row, flush=True)
    if not args.skip_hf:
        try:
            row = run_hf_cb(copy.deepcopy(model), work)
            rows.append(row)
            print(row, flush=True)
        except Exception as exc:  # report and go on: the other columns still mean something
            print(f"Transformers continuous batching failed here: {exc!r}")
    seq_outs = None
    if not args.skip_sequential:
        row, seq_outs = run_sequential(baseline_model, work)
        rows.append(row)
        print(row, flush=True)
    extra = {"compile": True} if args.compile else {}
    if args.native:  # decode-only steps through the native executor (docs/native.md)
        extra["native"] = True
    for name, value in extra.items():  # each on its own patch; the default Engine row stays last
        hf_accel.patch_model(model, **{name: value})
        row, extra_outs, _ = run_engine(model, work, args)
        row["method"] = f"hf_accel Engine + {name}=True"
        if seq_outs is not None:
            row["method"] += f" ({sum(a == b for a, b in zip(extra_outs, seq_outs, strict=True))} identical)"
        rows.append(row)
        print(row, flush=True)
        hf_accel.unpatch_model(model)
    hf_accel.patch_model(model)
    row, outs, engine = run_engine(model, work, args)
    rows.append(row)
    print(row, flush=True)
    same = None if seq_outs is None else sum(a == b for a, b in zip(outs, seq_outs, strict=True))
    print_table(rows, engine, same, len(outs))


def print_table(rows: list[dict], engine: Engine, same: int | None, total: int) -> None:
    """The Markdown table (speed-ups against the last row, the default Engine) and the Engine's counters."""
    print()
    print("| method | wall s | output tok/s | Engine speed-up | TTFT p50 / p90 s | TPOT p50 / p90 ms |")
    print("|---|---|---|---|---|---|")
    eng = rows[-1]["tok_s"]
    for r in rows:
        ttft = "-" if r["ttft_p50"] is None else f"{r['ttft_p50']:.1f} / {r['ttft_p90']:.1f}"
        tpot = "-" if r["tpot_p50"] is None else f"{1e3 * r['tpot_p50']:.0f} / {1e3 * r['tpot_p90']:.0f}"
        print(f"| {r['method']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {eng / r['tok_s']:.2f}x | {ttft} | {tpot} |")
    print(
        f"\nEngine: {engine.steps} steps, {engine.forward_tokens} tokens fed, {engine.scheduler.preemptions} "
        f"preemptions, peak pool {engine.cache.peak_blocks_used}/{engine.cache.num_blocks} blocks"
    )
    if same is not None:
        print(f"greedy outputs identical to sequential generate: {same}/{total}")


if __name__ == "__main__":
    main()
