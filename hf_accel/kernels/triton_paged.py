"""Paged decode attention as one Triton kernel launch per layer for the whole batch (CUDA; the CPU runs it in
Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the tests hold it to the reference).

One program per (row, K/V head) walks the row's blocks through its block table, reading K/V straight from the pool
(no gathered copy of the context), with an online softmax in float32. The walk has a compile-time bound, the table
width rounded up to a power of two (a handful of kernel variants as contexts grow; a data-dependent bound cannot run
in Triton's interpreter under NumPy 2): slots past a row's own tokens are masked, so they are never read. The
program's query tile holds every query head of the group and every query of the chunk (``G * Q`` rows, padded to 16
for ``tl.dot``), so grouped heads read each K/V block once and a speculative verification chunk costs one pass over
the context. Arguments and result are :func:`hf_accel.kernels.reference.paged_attention`'s.

Triton is imported on first use, never at import: :func:`load` returns the launcher, or why it cannot run.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PORTABLE_WHY_NOT", "WHY", "load"]

#: what :func:`hf_accel.kernels.ops.choose` says of this kernel, and of the portable implementation beside it
WHY = "one Triton launch for the whole batch, reading the pool in place"
PORTABLE_WHY_NOT = "gathers each row's context into a copy first"


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, len_ptr, out_ptr, width, scale, window, softcap,
        sq_b, sq_h, sq_q, sq_d, sk_n, sk_s, sk_h, sk_d, sv_n, sv_s, sv_h, sv_d, st_b, sp_b, so_b, so_q, so_h, so_d,
        GROUPS: tl.constexpr, QLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, M: tl.constexpr,
        DP: tl.constexpr, BP: tl.constexpr, TABLE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        b, kvh = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, M)  # tile row r: query head kvh * GROUPS + r // QLEN, chunk query r % QLEN
        row_ok = r < GROUPS * QLEN
        head, qi = kvh * GROUPS + r // QLEN, r % QLEN
        d = tl.arange(0, DP)
        d_ok = d < HEAD_DIM
        pos = tl.load(pos_ptr + b * sp_b + qi, mask=row_ok, other=-1)  # [M]
        q_off = b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_q + d[None, :] * sq_d
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, DP]
        stored = tl.load(len_ptr + b)  # tokens of this row in the pool (0: a released row)
        m_i = tl.full([M], -1.0e30, tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, DP], tl.float32)
        s_idx = tl.arange(0, BP)
        for j in range(0, TABLE):  # a fixed bound (the table width's bucket): blocks past the row's are all masked
            block = tl.load(table_ptr + b * st_b + j, mask=j < width, other=0).to(tl.int64)
            t = j * BLOCK + s_idx
            t_ok = (s_idx < BLOCK) & (t < stored)  # never-written slots are not even read
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + block * sk_n + s_idx[:, None] * sk_s + kvh * sk_h + d[None, :] * sk_d,
                        mask=kv_mask, other=0.0)  # fmt: skip
            if IEEE:  # noqa: SIM108 (Triton: a branch on a compile-time flag)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, BP]
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            if HAS_SOFTCAP:
                s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
            visible = (t[None, :] <= pos[:, None]) & t_ok[None, :]
            if HAS_WINDOW:
                visible = visible & (t[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + block * sv_n + s_idx[:, None] * sv_s + kvh * sv_h + d[None, :] * sv_d,
                        mask=kv_mask, other=0.0)  # fmt: skip
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)  # padding queries: zeros
        o_off = b * so_b + qi[:, None] * so_q + head[:, None] * so_h + d[None, :] * so_d
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return paged_decode


def paged_attention(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_pos: torch.Tensor,
    scale: float, window: int, softcap: float,
) -> torch.Tensor:  # fmt: skip
    """Query ``[B, H_q, Q, D]`` over pools ``[NB, BS, H_kv, D]`` through ``block_tables`` ``[B, MB]`` at ``q_pos``
    ``[B, Q]`` (-1: padding, zeros out) -> ``[B, Q, H_q, D]``: one launch, a ``(B, H_kv)`` grid."""
    batch, heads, q_len, dim = query.shape
    block, kv_heads = k_pool.shape[1], k_pool.shape[2]
    groups = heads // kv_heads
    out = torch.empty(batch, q_len, heads, dim, dtype=query.dtype, device=query.device)
    tables, pos = block_tables.to(torch.int32).contiguous(), q_pos.to(torch.int32).contiguous()
    stored = (pos.amax(dim=1) + 1).to(torch.int32)  # [B] tokens each row holds (on the device: no sync)
    _kernel()[(batch, kv_heads)](
        query, k_pool, v_pool, tables, pos, stored, out, tables.shape[1], float(scale), int(window),
        float(softcap or 1.0),
        *query.stride(), *k_pool.stride(), *v_pool.stride(), tables.stride(0), pos.stride(0), *out.stride(),
        GROUPS=groups, QLEN=q_len, HEAD_DIM=dim, BLOCK=block, M=_pow2(groups * q_len), DP=_pow2(dim),
        BP=_pow2(block), TABLE=_pow2(tables.shape[1], least=1), HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0,
        IEEE=query.dtype == torch.float32,
    )  # fmt: skip
    return out


def load() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """The Triton launcher, or ``None`` and why it cannot run here."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    return paged_attention, None
