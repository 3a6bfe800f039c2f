"""``hf-accel demo``: the default model answers chat prompts unpatched and patched, timed fairly.

Each configuration is its own copy of the model, warmed up first (kernel builds, compilation and first-call
allocations are not timed); then every repeat runs every configuration on every prompt, in an order that rotates
from repeat to repeat (no configuration is always first), and the table shows medians and each one's ratio to the
unpatched model measured in the same run.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from .core.config import Int8Config
from .core.metrics import GenerationTiming, TimingStreamer
from .models import load_default
from .patch import patch_model, patch_report

__all__ = ["CONFIGS", "run_demo"]

#: (row label, ``patch_model`` features; ``None``: unpatched, what the others are compared with)
CONFIGS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("unpatched", None),
    ("patched", {}),  # the default: on this CPU the native executor + automatic self-speculation of greedy calls
    ("+ int8", {"int8": Int8Config(keep_original=True)}),
)


def _answer(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, torch.Tensor, GenerationTiming]:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    streamer = TimingStreamer()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
    new = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), new, streamer.timing()


def _models(model: Any) -> dict[str, Any]:
    """One copy of the model per configuration, patched as it says."""
    out = {}
    for label, features in CONFIGS:
        copied = copy.deepcopy(model)
        out[label] = copied if features is None else patch_model(copied, **features)
    return out


def _median(values: list[float]) -> float:
    finite = [v for v in values if v == v]  # nan: fewer than two tokens
    return statistics.median(finite) if finite else float("nan")


def run_demo(prompts: list[str], max_new_tokens: int, repeats: int = 3) -> None:
    """Print a table of median TTFT and decode tokens/s per configuration (and the ratio to the unpatched model,
    measured in the same run), whether greedy outputs equal the unpatched model's, then the answers."""
    start = time.perf_counter()
    model, tokenizer = load_default()
    print(
        f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - start:.1f} s; torch threads: {torch.get_num_threads()}"
    )
    models = _models(model)
    report = patch_report(models["patched"])
    features = ", ".join(report["features"]) or "none"
    default = report["implementations"].get("default", {}).get("configuration", {}).get("uses", "")
    for m in models.values():  # warm-up: kernel builds, compilation and first-call allocations are not timed
        _answer(m, tokenizer, prompts[0], max_new_tokens)
    labels = list(models)
    runs: dict[str, list[tuple[str, torch.Tensor, GenerationTiming]]] = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:  # rotated: nobody always goes first
            runs[label] += [_answer(models[label], tokenizer, p, max_new_tokens) for p in prompts]
    print(f"patched (the default patch): {features}; {default}; int8 is opt-in (lossy)")
    print(f"medians over {repeats} interleaved repeats of {len(prompts)} prompt(s), {max_new_tokens} new tokens\n")
    print("| model     |       TTFT | decode t/s | vs unpatched | identical |")
    print("|-----------|------------|------------|--------------|-----------|")
    base_rate = _median([t.decode_tokens_per_s for _, _, t in runs["unpatched"]])
    for label in labels:
        rate = _median([t.decode_tokens_per_s for _, _, t in runs[label]])
        ttft = _median([t.ttft_s for _, _, t in runs[label]]) * 1000
        same = all(torch.equal(a[1], b[1]) for a, b in zip(runs[label], runs["unpatched"], strict=True))
        mark = "-" if label == "unpatched" else ("yes" if same else ("no" if label == "+ int8" else "NO"))
        print(f"| {label:<9} | {ttft:7.0f} ms | {rate:10.1f} | {rate / base_rate:11.2f}x | {mark:<9} |")
    print()
    for prompt, (text, _, _) in zip(prompts, runs["unpatched"], strict=False):
        print(f"> {prompt}\n{text.strip()}\n")
