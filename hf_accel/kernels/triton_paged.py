"""Paged decode attention in Triton: one launch per layer for the whole batch, two when a small batch splits its
contexts (CUDA; the CPU runs it in Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the tests hold it to
the reference).

One program per (row, K/V head, context split) walks its share of the row's blocks through the block table, reading
K/V straight from the pool (no gathered copy of the context), with an online softmax in float32; a small batch (few
rows x K/V heads) splits each row's context so the GPU has work for every SM, and a second small program merges the
splits' softmaxes in a fixed order (flash-decoding). The walk has a compile-time bound, the table width rounded up to
a power of two (a handful of kernel variants as contexts grow; a data-dependent bound cannot run in Triton's
interpreter under NumPy 2): slots past a row's own tokens are masked, so they are never read. The
program's query tile holds every query head of the group and every query of the chunk (``G * Q`` rows, padded to 16
for ``tl.dot``), so grouped heads read each K/V block once and a speculative verification chunk costs one pass over
the context. Arguments and result are :func:`hf_accel.kernels.reference.paged_attention`'s.

Triton is imported on first use, never at import (the programs live in :mod:`.triton_paged_jit`): :func:`load`
returns the launcher, or why it cannot run.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PORTABLE_WHY_NOT", "WHY", "load"]

#: what :func:`hf_accel.kernels.ops.choose` says of this kernel, and of the portable implementation beside it
WHY = "one Triton launch for the whole batch (two when short batches split contexts), reading the pool in place"
PORTABLE_WHY_NOT = "gathers each row's context into a copy first"


#: programs a launch aims for (about one per SM of an H100): fewer rows x K/V heads split each row's context
TARGET_PROGRAMS = 128


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


@functools.cache
def _programs() -> Any:
    from . import triton_paged_jit  # imports Triton

    return triton_paged_jit


def _splits(rows: int, kv_heads: int, table: int) -> int:
    """Context splits (a power of two dividing the table's bucket, at least 2 blocks each) so that a small batch
    still runs about :data:`TARGET_PROGRAMS` programs; 1 when ``rows * kv_heads`` programs are enough."""
    want = -(TARGET_PROGRAMS // -(rows * kv_heads))
    splits = 1
    while splits * 2 <= want and table // (splits * 2) >= 2:
        splits *= 2
    return splits


def paged_attention(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_pos: torch.Tensor,
    scale: float, window: int, softcap: float, sinks: torch.Tensor | None = None, splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Query ``[B, H_q, Q, D]`` over pools ``[NB, BS, H_kv, D]`` through ``block_tables`` ``[B, MB]`` at ``q_pos``
    ``[B, Q]`` (-1: padding, zeros out), with attention ``sinks`` ``[H_q]`` (or ``None``) -> ``[B, Q, H_q, D]``: a
    ``(B, H_kv, splits)`` grid, plus a merge of the splits when there are several (``splits``: ``None`` picks,
    :func:`_splits`)."""
    batch, heads, q_len, dim = query.shape
    block, kv_heads = k_pool.shape[1], k_pool.shape[2]
    groups = heads // kv_heads
    out = torch.empty(batch, q_len, heads, dim, dtype=query.dtype, device=query.device)
    tables, pos = block_tables.to(torch.int32).contiguous(), q_pos.to(torch.int32).contiguous()
    stored = (pos.amax(dim=1) + 1).to(torch.int32)  # [B] tokens each row holds (on the device: no sync)
    table = _pow2(tables.shape[1], least=1)  # the walk's bound: a few kernel variants as contexts grow
    splits = splits or _splits(batch, kv_heads, table)
    m, dp = _pow2(groups * q_len), _pow2(dim)
    shape = dict(GROUPS=groups, QLEN=q_len, HEAD_DIM=dim, M=m, DP=dp)
    programs = _programs()
    sink = out if sinks is None else sinks.to(torch.float32).contiguous()  # [H_q] (unread without sinks)
    partial = out
    maxes = sums = out  # unused with one split
    if splits > 1:
        maxes = torch.empty(batch, kv_heads, splits, m, dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxes)
        partial = torch.empty(batch, kv_heads, splits, m, dp, dtype=torch.float32, device=query.device)
    programs.paged_decode[(batch, kv_heads, splits)](
        query, k_pool, v_pool, tables, pos, stored, partial, maxes, sums, sink, tables.shape[1], float(scale),
        int(window), float(softcap or 1.0),
        *query.stride(), *k_pool.stride(), *v_pool.stride(), tables.stride(0), pos.stride(0), *out.stride(),
        BLOCK=block, BP=_pow2(block), PER=table // splits, SPLITS=splits, HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None, IEEE=query.dtype == torch.float32, **shape,
    )  # fmt: skip
    if splits > 1:
        programs.combine_splits[(batch, kv_heads)](
            maxes, sums, partial, out, sink, *out.stride(), SPLITS=splits, HAS_SINKS=sinks is not None, **shape
        )
    return out


def load() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """The Triton launcher, or ``None`` and why it cannot run here."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed"
    return paged_attention, None
