"""One run, every CPU path of issue 32 side by side: the memory-bandwidth limit, plain Transformers fp32 / bf16, each
hf_accel precision and path, and llama.cpp on GGUF files when ``llama-cpp-python`` is importable.

    python benchmarks/bench_cpu_peers.py [--new-tokens 64] [--repeats 3] [--gguf f32.gguf bf16.gguf q8_0.gguf]

Prints, per path: decode tok/s on a short chat prompt, decode tok/s and TTFT on a 388-token prompt, the decode rate
as a share of the bandwidth limit for its weight bytes (speculative paths can pass 100%: several tokens per weight
read), how many of the new tokens equal Transformers fp32's greedy
ones, and which kernel builds hf_accel ran (``patch_report``). Speed is never asserted: read the ratios of one run.
The GGUF files (llama.cpp's ``convert_hf_to_gguf.py`` on the converted default model, ``--outtype f32 / bf16 /
q8_0``) are optional; building ``llama-cpp-python`` takes 10-25 minutes, so it is never part of CI.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hf_accel
from hf_accel.core.metrics import TimingStreamer

LICENSE = Path("/usr/share/common-licenses/GPL-3")
CHAT = "Write a short poem about the sea."


def bandwidth_gbs(gib: int = 2) -> float:
    """Read bandwidth: ``torch.sum`` over ``gib`` GiB of float32 (the best of 3)."""
    x = torch.ones(gib * 2**28)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def _prompts(tokenizer: Any) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": CHAT}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    text = LICENSE.read_text() if LICENSE.is_file() else "The quick brown fox jumps over the lazy dog. " * 80
    long = tokenizer(text)["input_ids"][:388]
    return {"chat": chat["input_ids"], "388": torch.tensor([long])}


def _time_hf(model: Any, ids: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    streamer = TimingStreamer()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, streamer=streamer)  # fmt: skip
    timing = streamer.timing()
    return timing.decode_tokens_per_s, timing.ttft_s, out[0, ids.shape[1] :].tolist()


def _time_llama(llm: Any, ids: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    llm.reset()
    start, stamps, tokens = time.perf_counter(), [], []
    for token in llm.generate(ids[0].tolist(), temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == new:
            break
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), stamps[0] - start, tokens


def _paths(model: Any) -> dict[str, tuple[Callable[[], Any], str]]:
    """Label -> (a function building that model, the weight precision its bandwidth limit uses)."""
    int8 = hf_accel.Int8Config(keep_original=True)

    def patched(dtype: torch.dtype, **features: Any) -> Callable[[], Any]:
        return lambda: hf_accel.patch_model(copy.deepcopy(model).to(dtype), **features)

    return {
        "Transformers fp32": (lambda: copy.deepcopy(model), "fp32"),
        "Transformers bf16": (lambda: copy.deepcopy(model).to(torch.bfloat16), "bf16"),
        "hf_accel default (fp32)": (patched(torch.float32), "fp32"),
        "hf_accel native (fp32, no speculation)": (
            patched(torch.float32, speculative=hf_accel.SpeculativeConfig()), "fp32"),
        "hf_accel native=True (bf16: half_linear)": (patched(torch.bfloat16, native=True), "bf16"),
        "hf_accel int8 + native (fp32 activations)": (patched(torch.float32, int8=int8), "int8"),
        "hf_accel W8A8 + native": (patched(torch.float32, int8=hf_accel.Int8Config(activations="int8")), "int8"),
        "hf_accel int8 (bf16 model)": (patched(torch.bfloat16, int8=int8), "int8"),
    }  # fmt: skip


def _builds(model: Any) -> str:
    if not hf_accel.is_patched(model):
        return "-"
    found = {c["uses"] for per in hf_accel.patch_report(model)["implementations"].values() for c in per.values()}
    return ", ".join(sorted(u for u in found if u.startswith("cpu/"))) or "-"


def _run(timer: Callable[..., Any], target: Any, prompts: dict[str, torch.Tensor], new: int, repeats: int) -> dict:
    timer(target, prompts["chat"], 4)  # warm-up: kernel builds, drafts, first-call allocations
    chat = [timer(target, prompts["chat"], new) for _ in range(repeats)]
    long = [timer(target, prompts["388"], new) for _ in range(repeats)]
    return {
        "chat": statistics.median(r[0] for r in chat),
        "long": statistics.median(r[0] for r in long),
        "ttft": statistics.median(r[1] for r in long),
        "tokens": chat[-1][2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", nargs="*", default=[], help="llama.cpp GGUF files of the same weights")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = hf_accel.load_default()
    prompts = _prompts(tokenizer)
    gbs = bandwidth_gbs()
    params = sum(p.numel() for p in model.parameters())
    limit = {"fp32": gbs * 1e9 / (4 * params), "bf16": gbs * 1e9 / (2 * params), "int8": gbs * 1e9 / params}
    print(f"read bandwidth {gbs:.1f} GB/s: batch-1 decode limit fp32 {limit['fp32']:.0f}, bf16 {limit['bf16']:.0f}, "
          f"int8 {limit['int8']:.0f} tok/s; torch threads {torch.get_num_threads()}")  # fmt: skip
    rows = {}
    for label, (build, precision) in _paths(model).items():
        target = build()
        rows[label] = {**_run(_time_hf, target, prompts, args.new_tokens, args.repeats), "precision": precision,
                       "builds": _builds(target)}  # fmt: skip
        del target
    for path in args.gguf:
        try:
            from llama_cpp import Llama
        except ImportError:
            print("llama-cpp-python is not importable: the GGUF rows are skipped")
            break
        llm = Llama(model_path=path, n_threads=2, n_ctx=1024, verbose=False)
        precision = "int8" if "q8" in Path(path).name.lower() else "bf16" if "bf16" in path.lower() else "fp32"
        rows[f"llama.cpp {Path(path).name}"] = {**_run(_time_llama, llm, prompts, args.new_tokens, args.repeats),
                                                 "precision": precision, "builds": "llama.cpp"}  # fmt: skip
    reference = rows["Transformers fp32"]["tokens"]
    head = f"= fp32 greedy (of {len(reference)})"
    print(f"\n| path | chat tok/s | 388-token prompt: tok/s / TTFT | % of its limit | {head} | kernel builds |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        same = next((i for i, (a, b) in enumerate(zip(r["tokens"], reference, strict=False)) if a != b), len(reference))
        share = 100 * r["chat"] / limit[r["precision"]]
        print(f"| {label} | {r['chat']:.1f} | {r['long']:.1f} / {r['ttft']:.2f} s | {share:.0f}% ({r['precision']}) "
              f"| {same} | {r['builds']} |")  # fmt: skip


if __name__ == "__main__":
    main()
