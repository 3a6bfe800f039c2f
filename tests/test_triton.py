"""The Triton kernels (paged attention, int8 linear) held to the torch reference in Triton's interpreter
(``TRITON_INTERPRET=1``, in a subprocess: the variable must be set before Triton compiles anything). Skipped where
Triton is not installed (``pip install -e .[test]`` installs it); on CUDA, tests/test_cuda.py runs the compiled
kernels."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import os
import torch
from test_portable import _case
from helpers import assert_close, sink_logits
from hf_accel.kernels import reference, triton_paged

shapes = [(1, 4, 4, 1, 16, 4), (4, 4, 2, 1, 16, 4), (5, 8, 2, 3, 32, 16), (3, 6, 1, 4, 8, 1), (2, 4, 2, 2, 64, 128),
          (3, 12, 4, 5, 24, 16)]  # MHA, GQA, verification chunks, 1-token blocks, wide blocks, head_dim 24 (padded)
part = int(os.environ["PART"])  # two interpreter processes share the cases: one each per core
for shape in shapes[part::2]:
    for window, softcap, sinks in [(0, 0.0, None), (5, 0.0, sink_logits(shape[1])), (0, 20.0, None)]:
        args = _case(*shape)  # poisoned pools (NaN / inf in a block nobody owns), -1 and stale table entries
        expected = reference.paged_attention(*args, 0.3, window, softcap, sinks)
        for splits in (None, 1, 2, 4):  # None: the launcher's choice (here, a split context: few programs)
            got = triton_paged.paged_attention(*args, 0.3, window, softcap, sinks, splits=splits)
            name = f"{shape} window={window} softcap={softcap} sinks={sinks is not None} splits={splits}"
            assert_close(got, expected, atol=5e-6, rtol=1e-5, name=name)
# float16 only: the interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584, "not supported
# yet"); tests/test_cuda.py checks bfloat16 on a GPU
if part == 0:
    print("ok")
    raise SystemExit
for dtype, atol in ((torch.float16, 2e-3),):
    args = _case(4, 8, 2, 2, 32, 16, dtype)
    got = triton_paged.paged_attention(*args, 0.2, 0, 0.0, splits=2)
    assert got.dtype == dtype
    assert_close(got, reference.paged_attention(*args, 0.2, 0, 0.0), atol=atol, rtol=0, name=str(dtype))
from hf_accel.kernels import triton_int8

gen = torch.Generator().manual_seed(5)
for m, n, k in [(1, 96, 256), (3, 200, 384), (16, 64, 128), (5, 130, 200), (2, 4100, 64)]:  # tails, splits
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(n, 1, generator=gen) / 50
    for dtype, atol, rtol in ((torch.float32, 2e-5, 2e-6), (torch.float16, 2e-2, 1e-3)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        got = triton_int8.int8_linear(x, q, s)
        assert got.dtype == dtype
        want = reference.int8_linear(x, q, s)
        assert_close(got.float(), want, atol=atol, rtol=rtol, name=f"int8 {m}x{n}x{k} {dtype}")
x, q = torch.randn(40, 128, generator=gen), torch.randint(-127, 128, (32, 128), dtype=torch.int8, generator=gen)
for s in (torch.rand(32, 1, generator=gen) / 50, torch.rand(32, 4, generator=gen) / 50):  # prefill rows; groups
    assert_close(triton_int8.int8_linear(x, q, s), reference.int8_linear(x, q, s), atol=2e-5, rtol=2e-6, name="rest")
from hf_accel.kernels import triton_experts

for e, n, k, groups in [(6, 40, 128, 1), (5, 70, 200, 2), (3, 33, 96, 3)]:  # tails in N and K; group scales
    q = torch.randint(-127, 128, (e, n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(e, n, groups, generator=gen) / 50
    for rows, j in [(1, 2), (4, 3), (7, 1), (40, 8)]:  # decode; a verification chunk; a prompt (blocks of 16 pairs)
        ids = torch.randint(-1, e + 1, (rows, j), generator=gen)  # -1 and e: no expert, zeros
        for dtype, atol in ((torch.float32, 5e-5), (torch.float16, 5e-2)):  # |out| ~ 30: fp16's ulp there is 0.016
            x = torch.randn(rows, k, generator=gen).to(dtype)
            got = triton_experts.int8_experts_linear(x, ids, q, s)
            assert got.dtype == dtype
            want = reference.int8_experts_linear(x.float(), ids, q, s)
            assert_close(got.float(), want, atol=atol, rtol=1e-3, name=f"experts {e}x{n}x{k}/{groups} {rows}x{j}")
print("ok")
"""


def test_triton_kernels_match_the_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    parts = [subprocess.Popen([sys.executable, "-c", SCRIPT], env={**env, "PART": str(p)}, **pipes) for p in (0, 1)]
    for part, process in enumerate(parts):
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0 and out.strip().endswith("ok"), f"part {part}: {err[-4000:]}"
