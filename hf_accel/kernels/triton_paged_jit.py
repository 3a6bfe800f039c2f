"""The Triton programs of :mod:`.triton_paged` (this module imports Triton: :mod:`.triton_paged` imports it on first
use only). Tile rows ``r`` of a program are query head ``kvh * GROUPS + r // QLEN`` at chunk query ``r % QLEN``."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine_splits", "paged_decode"]


@triton.jit
def _scores(q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """``q`` ``[M, DP]`` x ``k`` ``[BP, DP]`` -> scaled (and soft-capped) scores ``[M, BP]`` float32."""
    if IEEE:  # noqa: SIM108 (Triton: a branch on a compile-time flag)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    return s


@triton.jit
def _with_sinks(m_i, l_i, acc, sink_ptr, head, row_ok):
    """Add each row's sink logit (``sink_ptr[head]``) to its softmax: rescaled ``(l_i, acc)``; rows with nothing
    visible (``l_i == 0``: padding) stay empty, so they still come out as zeros."""
    sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    m_f = tl.maximum(m_i, sink)
    old = tl.exp(m_i - m_f)
    l_f = tl.where(l_i > 0, l_i * old + tl.exp(sink - m_f), 0.0)
    return l_f, acc * old[:, None]


@triton.jit
def paged_decode(
    q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, len_ptr, out_ptr, m_ptr, l_ptr, sink_ptr, width, scale, window, softcap,
    sq_b, sq_h, sq_q, sq_d, sk_n, sk_s, sk_h, sk_d, sv_n, sv_s, sv_h, sv_d, st_b, sp_b, so_b, so_q, so_h, so_d,
    GROUPS: tl.constexpr, QLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, M: tl.constexpr,
    DP: tl.constexpr, BP: tl.constexpr, PER: tl.constexpr, SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Program (row b, K/V head kvh, split): blocks ``split * PER ..`` of the row's table, online softmax. One split:
    the normalised output; several: the split's max, sum and unnormalised values (``combine_splits`` merges them)."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, M)
    row_ok = r < GROUPS * QLEN
    head, qi = kvh * GROUPS + r // QLEN, r % QLEN
    d = tl.arange(0, DP)
    d_ok = d < HEAD_DIM
    pos = tl.load(pos_ptr + b * sp_b + qi, mask=row_ok, other=-1)  # [M]
    q = tl.load(q_ptr + b * sq_b + head[:, None] * sq_h + qi[:, None] * sq_q + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    stored = tl.load(len_ptr + b)  # tokens of this row in the pool (0: a released row)
    m_i = tl.full([M], -1.0e30, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DP], tl.float32)
    s_idx = tl.arange(0, BP)
    for j0 in range(0, PER):  # a fixed bound: blocks past the row's own are all masked, never read
        j = split * PER + j0
        block = tl.load(table_ptr + b * st_b + j, mask=j < width, other=0).to(tl.int64)
        t = j * BLOCK + s_idx
        t_ok = (s_idx < BLOCK) & (t < stored)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * sk_n + s_idx[:, None] * sk_s + kvh * sk_h + d[None, :] * sk_d, mask=kv_mask,
                    other=0.0)  # fmt: skip
        s = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)  # [M, BP]
        visible = (t[None, :] <= pos[:, None]) & t_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (t[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block * sv_n + s_idx[:, None] * sv_s + kvh * sv_h + d[None, :] * sv_d, mask=kv_mask,
                    other=0.0)  # fmt: skip
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    keep = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        if HAS_SINKS:
            l_i, acc = _with_sinks(m_i, l_i, acc, sink_ptr, head, row_ok)
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)  # padding queries: zeros
        o_off = b * so_b + qi[:, None] * so_q + head[:, None] * so_h + d[None, :] * so_d
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=keep)
    else:  # partials: [B, H_kv, SPLITS, M] max and sum, [B, H_kv, SPLITS, M, DP] values
        at = (b * tl.num_programs(1) + kvh) * SPLITS + split
        tl.store(m_ptr + at * M + r, m_i)
        tl.store(l_ptr + at * M + r, l_i)
        tl.store(out_ptr + (at * M + r[:, None]) * DP + d[None, :], acc)


@triton.jit
def combine_splits(
    m_ptr, l_ptr, part_ptr, out_ptr, sink_ptr, so_b, so_q, so_h, so_d,
    GROUPS: tl.constexpr, QLEN: tl.constexpr, HEAD_DIM: tl.constexpr, M: tl.constexpr, DP: tl.constexpr,
    SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Program (row b, K/V head kvh): merge the splits' partial softmaxes in order and store the output."""
    b, kvh = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, M)
    d = tl.arange(0, DP)
    m_all = tl.full([M], -1.0e30, tl.float32)
    l_all = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DP], tl.float32)
    for split in range(0, SPLITS):
        at = (b * tl.num_programs(1) + kvh) * SPLITS + split
        m_s = tl.load(m_ptr + at * M + r)
        l_s = tl.load(l_ptr + at * M + r)
        part = tl.load(part_ptr + (at * M + r[:, None]) * DP + d[None, :])
        m_new = tl.maximum(m_all, m_s)
        old, new = tl.exp(m_all - m_new), tl.exp(m_s - m_new)
        l_all = l_all * old + l_s * new
        acc = acc * old[:, None] + part * new[:, None]
        m_all = m_new
    row_ok = r < GROUPS * QLEN
    head, qi = kvh * GROUPS + r // QLEN, r % QLEN
    if HAS_SINKS:
        l_all, acc = _with_sinks(m_all, l_all, acc, sink_ptr, head, row_ok)
    out = tl.where(l_all[:, None] > 0, acc / tl.where(l_all > 0, l_all, 1.0)[:, None], 0.0)
    o_off = b * so_b + qi[:, None] * so_q + head[:, None] * so_h + d[None, :] * so_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])
