"""A mixture of experts' weight-only int8 linear as a Triton kernel (CUDA; the CPU runs it in Triton's interpreter,
which is how the tests hold it to the reference).

``out[p] = x[p // J] @ (qweight[ids[p]] * scale[ids[p]])^T`` for every (row, expert) pair ``p``, grouped by expert on
the device, without a host read (so a call never waits for the GPU and can be captured in a CUDA graph), the way
vLLM's fused MoE lays out its work: :func:`align` sorts the pairs by expert and pads each expert's run to a multiple
of ``BLOCK_M`` pairs, so that every block of ``BLOCK_M`` sorted pairs belongs to one expert. One program per (block,
``BLOCK_N`` outputs) then reads that expert's int8 rows once, in coalesced ``[BLOCK_N, BLOCK_K]`` tiles, converts
them in registers and multiplies them with the block's activation rows by ``tl.dot`` (float32 sums; row scales on
the sums, group scales on the weights). The number of blocks in use is only known on the device: the grid is its
upper bound (``cdiv(P, BLOCK_M) + min(E, P)``) and programs past the end do nothing. Triton is imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PORTABLE_WHY_NOT", "WHY", "align", "int8_experts_linear", "load"]

#: what :func:`hf_accel.kernels.ops.choose` says of this kernel, and of the portable implementation beside it
WHY = ("a Triton kernel over the (token, expert) pairs grouped by expert on the device: each hit expert's int8 rows "
       "read once per block of pairs, no host sync (CUDA-graph safe)")  # fmt: skip
PORTABLE_WHY_NOT = "de-quantizes a gathered copy of each pair's weights, or reads the counts on the host"

BLOCK_N, BLOCK_K = 64, 64


def _block_m(pairs: int) -> int:
    """Pairs per block: 16 (tl.dot's least) for decode-sized calls, 64 for prompts (fewer re-reads of each expert)."""
    return 16 if pairs <= 1024 else 64


def align(flat: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the pairs out by expert, on the device (no host read).

    Args:
        flat: ``[P]`` expert id of each pair (one outside ``[0, E)`` is dropped).
        num_experts: ``E``.
        block: pairs per block.

    Returns:
        ``pairs [B * block]`` (the pair at each slot, ``-1`` for padding), ``experts [B]`` (the expert of each block)
        and ``used [1]`` (blocks in use), where ``B = cdiv(P, block) + min(E, P)`` bounds the blocks any routing needs.
    """
    count = flat.numel()
    blocks = -(count // -block) + min(num_experts, count)
    valid = (flat >= 0) & (flat < num_experts)
    keyed = torch.where(valid, flat, num_experts)  # [P] an invalid id sorts last
    # [E] pairs per expert (scatter_add, not bincount: on CUDA bincount reads the largest id back to size its result)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add_(0, keyed, torch.ones_like(keyed))[:num_experts]
    padded = (counts + block - 1) // block * block  # [E]
    ends = torch.cumsum(padded, 0)  # [E] end slot of each expert's run
    order = torch.argsort(keyed, stable=True)  # [P] pairs grouped by expert
    expert = keyed[order].clamp(max=num_experts - 1)  # [P]
    first = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
    slot = ends[expert] - padded[expert] + torch.arange(count, device=flat.device) - first[expert]  # [P]
    slot = torch.where(keyed[order] < num_experts, slot, blocks * block)  # dropped pairs: the spare slot
    pairs = torch.full((blocks * block + 1,), -1, dtype=torch.int64, device=flat.device)
    pairs.scatter_(0, slot, order)
    starts = torch.arange(blocks, device=flat.device) * block  # [B]
    experts = torch.searchsorted(ends, starts, right=True).clamp(max=num_experts - 1)  # [B]
    used = ends[-1:] // block  # [1]
    return pairs[:-1], experts, used


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_w8a16(
        x_ptr, pairs_ptr, experts_ptr, used_ptr, w_ptr, s_ptr, out_ptr, J, N, K, GROUP, sxr, swe, swn, sse, ssn,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROW_SCALES: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        blk, pid_n = tl.program_id(0), tl.program_id(1)
        live = tl.load(used_ptr) > blk
        expert = tl.load(experts_ptr + blk)
        pair = tl.load(pairs_ptr + blk * BM + tl.arange(0, BM))  # [BM] -1: padding
        m_ok = tl.where(live, pair >= 0, False)  # (a where, not &: the interpreter's masks need it)
        row = tl.where(m_ok, pair // J, 0)
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = tl.where(live, rn < N, False)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < K
            x = tl.load(x_ptr + row[:, None] * sxr + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + expert * swe + rn[:, None] * swn + rk[None, :], mask=w_mask, other=0)  # [BN, BK]
            if ROW_SCALES:  # int8 values are exact in the activation dtype: the scale goes on the sums
                wx = w.to(x.dtype)
            else:
                s = tl.load(s_ptr + expert * sse + rn[:, None] * ssn + rk[None, :] // GROUP, mask=w_mask, other=0.0)
                wx = (w.to(tl.float32) * s).to(x.dtype)
            if IEEE:  # a branch on a compile-time flag
                acc += tl.dot(x, tl.trans(wx), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(wx))
        if ROW_SCALES:
            acc *= tl.load(s_ptr + expert * sse + rn * ssn, mask=n_ok, other=0.0)[None, :]
        keep = m_ok[:, None] & n_ok[None, :]
        tl.store(out_ptr + pair[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)

    return grouped_w8a16


def int8_experts_linear(
    x: torch.Tensor, expert_ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``x [R, K]``, ``expert_ids [R, J]``, ``qweight [E, N, K]`` int8, ``scale [E, N, G]`` -> ``[R, J, N]`` in ``x``'s
    dtype (:func:`hf_accel.kernels.reference.int8_experts_linear`); any number of pairs, no host sync."""
    rows, j = expert_ids.shape
    num_experts, n, k = qweight.shape
    x = x.contiguous()
    qweight, scale = qweight.contiguous(), scale.float().contiguous()
    out = torch.zeros(rows, j, n, dtype=x.dtype, device=x.device)
    if rows * j == 0:
        return out
    block = _block_m(rows * j)
    pairs, experts, used = align(expert_ids.reshape(-1).long(), num_experts, block)
    groups = scale.shape[2]
    _kernel()[(experts.numel(), -(n // -BLOCK_N))](
        x, pairs, experts, used, qweight, scale, out, j, n, k, k // groups, x.stride(0), qweight.stride(0),
        qweight.stride(1), scale.stride(0), scale.stride(1), BM=block, BN=BLOCK_N, BK=BLOCK_K, ROW_SCALES=groups == 1,
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return out


def load() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """The Triton launcher, or ``None`` and why it cannot run here."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    return int8_experts_linear, None
