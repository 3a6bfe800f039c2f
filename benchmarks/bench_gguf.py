"""GGUF files through Transformers' ``gguf_file=`` loading (de-quantized to float32): which linears the exact-codes
finder recovers, and greedy decode speed of the default patch against its variants and llama.cpp on the same file.

For each file: the linears found as codes (by width) and the time ``find_codes`` took; then decode tok/s (64-token
prompt, ``--new`` new tokens, after the first token, best of 3) of the default patch, of the same model with the
automatic int8 draft forced on and off over its coded steps, of the float weights with the draft
(``NativeConfig(exact_codes=False)``), and of llama.cpp (``llama-cpp-python``, where installed). Every hf_accel row
checks its tokens against the unpatched model's.

    python benchmarks/bench_gguf.py /tmp/gguf/smollm2-q4_k_m.gguf /tmp/gguf/smollm2-q8_0.gguf
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import hf_accel
import hf_accel.speculative.auto as auto
from hf_accel import NativeConfig
from hf_accel.quant.codes import find_codes

PROMPT = 64


def load(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def coverage(model: Any) -> str:
    found: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            codes = find_codes(module.weight)
            found["float" if isinstance(codes, str) else f"{codes.bits}-bit"] += 1
    seconds = time.perf_counter() - start
    return ", ".join(f"{n} {k}" for k, n in sorted(found.items())) + f" ({seconds:.1f} s to find)"


def decode_rate(model: Any, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=new, **greedy)  # warm-up (builds the draft where one is used)
    best, out = 0.0, None
    for _ in range(3):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **greedy)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, **greedy)
        best = max(best, (new - 1) / (time.perf_counter() - start - first))
    return best, out[0, ids.shape[1] :].tolist()


def llama_rate(path: Path, ids: torch.Tensor, new: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=2, n_ctx=PROMPT + new + 8, verbose=False)
    best = 0.0
    for _ in range(3):
        llm.reset()
        stamps = []
        for _token in llm.generate(ids[0].tolist(), temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == new:
                break
        best = max(best, (new - 1) / (stamps[-1] - stamps[0]))
    return best


def variants() -> dict[str, Callable[[Any], Any]]:
    return {
        "default patch": lambda m: hf_accel.patch_model(m),
        "codes, no draft": lambda m: _with_share(0.0, m),
        "codes + int8 draft": lambda m: _with_share(100.0, m),
        "float weights + int8 draft": lambda m: hf_accel.patch_model(m, native=NativeConfig(exact_codes=False)),
    }


def _with_share(share: float, model: Any) -> Any:
    """The default patch with the draft rule's threshold moved (measurement only; restored at the end of the run)."""
    auto.DRAFT_SHARE = share
    return hf_accel.patch_model(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    ids = torch.randint(100, 40000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    default_share = auto.DRAFT_SHARE
    for path in args.files:
        plain = load(path)
        print(f"{path.name}: linears {coverage(plain)}", flush=True)
        greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = plain.generate(ids, max_new_tokens=args.new, **greedy)[0, PROMPT:].tolist()
        for name, patch in variants().items():
            try:
                rate, tokens = decode_rate(patch(load(path)), ids, args.new)
            finally:
                auto.DRAFT_SHARE = default_share
            print(f"  {name}: {rate:.1f} tok/s, tokens {'equal' if tokens == expected else 'DIFFER'}", flush=True)
        if importlib.util.find_spec("llama_cpp") is not None:
            print(f"  llama.cpp: {llama_rate(path, ids, args.new):.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
