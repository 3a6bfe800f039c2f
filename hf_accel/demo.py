"""``hf-accel demo``: the default model answers chat prompts unpatched and patched, side by side."""

from __future__ import annotations

import time

import torch

from .core.config import Int8Config
from .core.metrics import GenerationTiming, TimingStreamer
from .models import load_default
from .patch import patch_model, patch_report, unpatch_model

__all__ = ["run_demo"]


def _answer(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, torch.Tensor, GenerationTiming]:
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    streamer = TimingStreamer()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer)
    new = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), new, streamer.timing()


def _row(label: str, timing: GenerationTiming, same: str) -> str:
    return f"| {label:<9} | {timing.ttft_s * 1000:7.0f} ms | {timing.decode_tokens_per_s:9.1f} | {same:<9} |"


def run_demo(prompts: list[str], max_new_tokens: int) -> None:
    """Print each prompt's answer and a table of TTFT, decode tokens/s and whether outputs are identical."""
    start = time.perf_counter()
    model, tokenizer = load_default()
    print(
        f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - start:.1f} s; torch threads: {torch.get_num_threads()}"
    )
    _answer(model, tokenizer, "Hi", 4)  # warm-up: first-call allocations should not count
    plain = [_answer(model, tokenizer, p, max_new_tokens) for p in prompts]
    patch_model(model)
    features = ", ".join(patch_report(model)["features"]) or "none"
    _answer(model, tokenizer, "Hi", 4)
    fast = [_answer(model, tokenizer, p, max_new_tokens) for p in prompts]
    unpatch_model(model)
    patch_model(model, int8=Int8Config(keep_original=True))
    _answer(model, tokenizer, "Hi", 4)
    int8 = [_answer(model, tokenizer, p, max_new_tokens) for p in prompts]
    unpatch_model(model)
    print(f"patched features: {features}; '+ int8' adds weight-only int8 (lossy, opt-in)\n")
    print("| model     |       TTFT | decode t/s | identical |")
    print("|-----------|------------|------------|-----------|")
    for prompt, (text, ids, t0), (_, ids1, t1), (_, ids2, t2) in zip(prompts, plain, fast, int8, strict=True):
        print(_row("unpatched", t0, "-"))
        print(_row("patched", t1, "yes" if torch.equal(ids, ids1) else "NO"))
        print(_row("+ int8", t2, "yes" if torch.equal(ids, ids2) else "no"))
        print(f"\n> {prompt}\n{text.strip()}\n")
