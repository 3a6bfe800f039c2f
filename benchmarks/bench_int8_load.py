"""Peak memory and time of loading a model as int8: the Transformers way (hf_accel's quantizer) against loading float
and then ``patch_model(model, int8=True)``, each in a fresh process (peak RSS is per process).

    python benchmarks/bench_int8_load.py [--model PATH] [--dtype float32|bfloat16]

Without ``--model`` it uses the default model (SmolLM2-135M-Instruct, converted once by ``hf_accel.load_default``).
Rows: ``float`` (plain ``from_pretrained``: the reference), ``float -> patch int8``, ``quantize while loading``
(``from_pretrained(path, quantization_config=hf_accel.Int8Config())``) and ``int8 checkpoint`` (``from_pretrained``
of what the previous row saved). Prints, after loading and again after a 16-token generate (every weight resident),
the peak RSS (``ru_maxrss``: it also counts the checkpoint's memory-mapped file pages, which the kernel can drop) and
the peak private memory (``RssAnon``, sampled every 2 ms: what the process itself holds), each against the float
load, plus the load seconds; and checks that the three int8 models give the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODES = ("float", "float -> patch int8", "quantize while loading", "int8 checkpoint")

CHILD = r"""
import json, resource, sys, threading, time
import torch
import hf_accel
from transformers import AutoModelForCausalLM
mode, path, dtype, save = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), sys.argv[4]
hf_accel.register_quantizer()
anon = [0]  # peak private memory (RssAnon): what the process needs; RSS also counts the checkpoint's mapped pages
def sample():
    while True:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
        anon[0] = max(anon[0], kib * 1024)
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
if mode == "float":
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
elif mode == "float -> patch int8":
    model = hf_accel.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), int8=True)
elif mode == "quantize while loading":
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=hf_accel.Int8Config())
else:
    model = AutoModelForCausalLM.from_pretrained(save, dtype=dtype)
seconds = time.perf_counter() - start
time.sleep(0.02)
load_rss, load_anon = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, anon[0]
ids = torch.tensor([[1, 504, 3458, 314, 2379, 281, 253, 1345, 30]])
tokens = model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)[0].tolist()  # every weight resident
time.sleep(0.02)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
row = {"load_rss": load_rss, "load_anon": load_anon, "peak": peak, "anon": anon[0]}
print(json.dumps({**row, "seconds": seconds, "tokens": tokens}))
if mode == "quantize while loading":
    model.save_pretrained(save)
"""


def _run(mode: str, path: str, dtype: str, save: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, path, dtype, save], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the converted default model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    if args.model is None:
        import hf_accel

        hf_accel.load_default()  # converts once
        from hf_accel.models import default_model_dir

        args.model = str(default_model_dir())
    with tempfile.TemporaryDirectory() as save:
        rows = {mode: _run(mode, args.model, args.dtype, save) for mode in MODES}
    base = rows["float"]
    print(f"model {args.model}, dtype {args.dtype}; loading, then loading plus a 16-token generate")
    cols = (("load_rss", "load RSS"), ("load_anon", "load private"), ("peak", "+gen RSS"), ("anon", "+gen private"))
    print(f"{'load':<24}" + "".join(f" {title:>12} {'vs float':>8}" for _, title in cols) + f" {'load s':>7}")
    for mode, row in rows.items():
        cells = "".join(f" {row[key] / 2**20:>8.0f} MiB {row[key] / base[key]:>7.2f}x" for key, _ in cols)
        print(f"{mode:<24}{cells} {row['seconds']:>7.2f}")
    int8 = [rows[m]["tokens"] for m in MODES[1:]]
    print("int8 greedy tokens equal across the three int8 loads:", all(t == int8[0] for t in int8))


if __name__ == "__main__":
    main()
