"""A mixture of experts' weight-only int8 linear as a Triton kernel (CUDA; the CPU runs it in Triton's interpreter,
which is how the tests hold it to the reference).

``out[p] = x[p // J] @ (qweight[ids[p]] * scale[ids[p]])^T`` for every (row, expert) pair ``p``: one program per
pair and ``BLOCK_N`` outputs reads that expert's int8 rows in place, in coalesced ``[BLOCK_N, BLOCK_K]`` tiles,
scales them by their groups in registers and reduces against the row's activations in float32. The expert of a pair
is read on the device, so a call never waits for it and can be captured in a CUDA graph. A pair reads its expert's
weights itself (two pairs of one expert read them twice), which is what decode wants (a few pairs, most experts hit
once); prefill-sized calls (more than :data:`MAX_PAIRS` pairs, outside a graph capture) group the pairs by expert
instead (:func:`hf_accel.kernels.portable.int8_experts_linear`). Triton is imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from . import portable

__all__ = ["MAX_PAIRS", "PORTABLE_WHY_NOT", "WHY", "int8_experts_linear", "load"]

#: what :func:`hf_accel.kernels.ops.choose` says of this kernel, and of the portable implementation beside it
WHY = "a Triton kernel reading each (row, expert) pair's int8 weights in place, the expert id read on the device"
PORTABLE_WHY_NOT = "de-quantizes a gathered copy of each pair's weights"

#: up to this many (row, expert) pairs the kernel runs outside a CUDA graph capture (decode, verification chunks)
MAX_PAIRS = 256
BLOCK_N, BLOCK_K = 32, 128


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def experts_w8a16(
        x_ptr, ids_ptr, w_ptr, s_ptr, out_ptr, J, E, N, K, G, GROUP, sxr, swe, swn, sse, ssn,
        BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        pid_n, pair = tl.program_id(0), tl.program_id(1)
        expert = tl.load(ids_ptr + pair)
        ok = (expert >= 0) & (expert < E)
        expert = tl.where(ok, expert, 0)
        row = pair // J
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        acc = tl.zeros([BN], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            x = tl.load(x_ptr + row * sxr + rk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
            mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + expert * swe + rn[:, None] * swn + rk[None, :], mask=mask, other=0)  # [BN, BK]
            s = tl.load(s_ptr + expert * sse + rn[:, None] * ssn + rk[None, :] // GROUP, mask=mask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * s * x[None, :], axis=1)
        acc = tl.where(ok, acc, 0.0)
        tl.store(out_ptr + pair * N + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    return experts_w8a16


def int8_experts_linear(
    x: torch.Tensor, expert_ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x [R, K]``, ``expert_ids [R, J]``, ``qweight [E, N, K]`` int8, ``scale [E, N, G]`` -> ``[R, J, N]`` in ``x``'s
    dtype (:func:`hf_accel.kernels.reference.int8_experts_linear`): the Triton kernel for up to :data:`MAX_PAIRS` pairs
    or while a CUDA graph is captured, else the pairs grouped by expert
    (:func:`hf_accel.kernels.portable.int8_experts_linear`)."""
    rows, j = expert_ids.shape
    num_experts, n, k = qweight.shape
    pairs = rows * j
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if pairs > MAX_PAIRS and not capturing:
        return portable.int8_experts_linear(x, expert_ids, qweight, scale)
    x = x.contiguous()
    ids = expert_ids.reshape(-1).contiguous()  # [P]
    qweight, scale = qweight.contiguous(), scale.float().contiguous()
    out = torch.empty(rows, j, n, dtype=x.dtype, device=x.device)
    if pairs:
        groups = scale.shape[2]
        _kernel()[(-(n // -BLOCK_N), pairs)](
            x, ids, qweight, scale, out, j, num_experts, n, k, groups, k // groups, x.stride(0), qweight.stride(0),
            qweight.stride(1), scale.stride(0), scale.stride(1), BN=BLOCK_N, BK=BLOCK_K,
        )  # fmt: skip
    return out


def load() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """The Triton launcher, or ``None`` and why it cannot run here."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    return int8_experts_linear, None
