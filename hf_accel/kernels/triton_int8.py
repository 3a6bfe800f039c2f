"""Weight-only int8 linear for decode-sized calls as a Triton kernel (CUDA; the CPU runs it in Triton's interpreter,
which is how the tests hold it to the reference).

``y = (x @ qweight^T) * scale``: the int8 weight is read once, as int8, in coalesced ``[BLOCK_N, BLOCK_K]`` tiles,
converted in registers and multiplied with ``tl.dot``; float32 sums. A decode matmul is a matrix-vector product
bound by the weight's bytes, so the ``N / BLOCK_N`` tiles are also split along ``K`` (enough programs to fill the
GPU); the split sums land in a float32 ``[SPLIT, M, N]`` buffer that a second small kernel adds in a fixed order
(deterministic), scales and casts (unsplit calls scale and store directly: one or two launches per call). PyTorch's
own ``torch._weight_int8pack_mm`` CUDA kernel is not used: it runs one thread per output and reads each weight row
with a stride of ``K`` between neighbouring threads.

Row scales and up to :data:`MAX_ROWS` rows only; other calls (prefill, grouped scales) de-quantize in the input
dtype and run cuBLAS (:func:`hf_accel.kernels.portable.int8_linear_compiled`). Triton is imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from . import portable

__all__ = ["MAX_ROWS", "PORTABLE_WHY_NOT", "WHY", "int8_linear", "load"]

#: what :func:`hf_accel.kernels.ops.choose` says of this kernel, and of the portable implementation beside it
WHY = "a Triton W8A16 matmul reading the int8 weight in place for decode-sized calls (de-quantize + cuBLAS above)"
PORTABLE_WHY_NOT = "de-quantizes a copy of the weight on every call"

#: up to this many rows (decode, verification chunks) the Triton kernel runs
MAX_ROWS = 16
BLOCK_N, BLOCK_K = 64, 128
#: programs the split aims for (about two per SM of an H100)
TARGET_PROGRAMS = 264


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def w8a16(
        x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, ITERS: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        rm = tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk0 = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for i in range(0, ITERS):  # this program's K tiles: pid_k, pid_k + SPLIT, ...
            rk = (i * SPLIT + pid_k) * BK + rk0
            k_ok = rk < K
            x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & k_ok[None, :],
                        other=0.0)  # fmt: skip
            w = tl.load(w_ptr + rn[:, None] * swn + rk[None, :] * swk, mask=(rn[:, None] < N) & k_ok[None, :],
                        other=0)  # fmt: skip
            if IEEE:  # a branch on a compile-time flag
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        keep = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:  # the whole sum: scale and store in the output dtype
            scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
            out = acc * scale[None, :]
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)
        else:  # a partial sum: [SPLIT, M, N] float32, added by the reduction
            tl.store(out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=keep)

    @triton.jit
    def reduce_splits(part_ptr, s_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat [M * N] index
        ok = i < M * N
        total = tl.zeros([BLOCK], tl.float32)
        for j in range(0, SPLIT):  # in order: the same sum every run
            total += tl.load(part_ptr + j * M * N + i, mask=ok, other=0.0)
        scale = tl.load(s_ptr + i % N, mask=ok, other=0.0)
        tl.store(out_ptr + i, (total * scale).to(out_ptr.dtype.element_ty), mask=ok)

    return w8a16, reduce_splits


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _split(n: int, k: int) -> int:
    """K splits so that ``N / BLOCK_N * splits`` programs reach :data:`TARGET_PROGRAMS` (at most one per K tile)."""
    tiles_n, tiles_k = _cdiv(n, BLOCK_N), _cdiv(k, BLOCK_K)
    return max(1, min(tiles_k, _cdiv(TARGET_PROGRAMS, tiles_n)))


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` @ ``(qweight [N, K] int8 * scale [N, G])^T`` -> ``[M, N]`` in ``x``'s dtype: the Triton kernel for
    up to :data:`MAX_ROWS` rows with row scales, else :func:`hf_accel.kernels.portable.int8_linear_compiled`."""
    m, k = x.shape
    n = qweight.shape[0]
    if m > MAX_ROWS or scale.shape[1] != 1:
        return portable.int8_linear_compiled(x, qweight, scale)
    split = _split(n, k)
    matmul, reduce_splits = _kernels()
    scale = scale.view(n).float()  # a no-op for the float32 scales Int8Linear holds
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    matmul[(_cdiv(n, BLOCK_N), split)](
        x, qweight, scale, partial, m, n, k, *x.stride(), *qweight.stride(),
        BM=16, BN=BLOCK_N, BK=BLOCK_K, SPLIT=split, ITERS=_cdiv(_cdiv(k, BLOCK_K), split),
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    if split > 1:  # two launches in all, whatever the split
        reduce_splits[(_cdiv(m * n, 1024),)](partial, scale, out, m, n, SPLIT=split, BLOCK=1024)
    return out  # [M, N]


def load() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """The Triton launcher, or ``None`` and why it cannot run here."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    return int8_linear, None
