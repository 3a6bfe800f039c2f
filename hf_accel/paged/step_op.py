"""The pool write and attention of one layer of a compiled decode step (the ``compile`` feature's paged step,
:mod:`hf_accel.compile.paged_step`), as the op ``hf_accel::paged_decode`` that ``torch.compile`` keeps opaque.

The compiled step plans its chunk in Python before the forward (:class:`DecodePlan`: slots, block tables, positions
and every layer's pools) and passes it to the model's ``forward`` as one keyword argument, which Transformers hands
down to every attention call; the paged attention function then calls this op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..kernels import flex_paged, portable, reference, triton_paged
from ..kernels.ops import choose, define_composite

__all__ = ["DecodePlan", "define_paged_op"]


class DecodePlan(NamedTuple):
    """One compiled step's plan (``Q`` new tokens per row), passed to every layer's attention (on its device).

    Args:
        slots: ``[B*Q]`` int64 pool slot of each new token (row-major); -1 for a token not stored (a released
            row, a hole).
        block_tables: ``[B, MB]`` int32.
        q_pos: ``[B, Q]`` int32 index of each new token in its sequence; -1 for a token not stored.
        keys / values: every layer's K and V pool, ``[num_blocks, block_size, H_kv, D]`` each; in a regionally
            compiled step (:mod:`hf_accel.compile.regional`) a layer's plan holds its own pools (one tensor each).
        attention: how to attend, as the cache chose (:func:`~.attention.attention_choice`): ``"native"`` (the
            CPU kernel), ``"triton"`` (:mod:`hf_accel.kernels.triton_paged`), ``"flex"``
            (:mod:`hf_accel.kernels.flex_paged`), ``"portable"``
            (:func:`hf_accel.kernels.portable.paged_attention`) or ``"reference"``
            (:func:`hf_accel.kernels.reference.paged_attention`).
    """

    slots: torch.Tensor
    block_tables: torch.Tensor
    q_pos: torch.Tensor
    keys: tuple[torch.Tensor, ...] | torch.Tensor
    values: tuple[torch.Tensor, ...] | torch.Tensor
    attention: str


def _write(pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``new`` ([B, H_kv, Q, D]) at ``slots`` ([B*Q], -1 = skip) of ``pool`` ([NB, BS, H_kv, D]).

    On the CPU the skipped tokens are dropped first (reading ``slots`` costs nothing there); on accelerators the
    portable write never reads them on the host (:func:`hf_accel.kernels.portable.pool_write`)."""
    if not pool.is_cpu:
        portable.pool_write(pool, new, slots)
        return
    rows = new.transpose(1, 2).reshape(-1, *pool.shape[2:])  # [B*Q, H_kv, D]
    keep = slots >= 0
    if not bool(keep.all()):
        rows, slots = rows[keep], slots[keep]
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, rows.to(pool.dtype))


def _paged_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    attention: str,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # query: [B, H_q, Q, D]; key/value: [B, H_kv, Q, D]; sinks: [H_q] or None -> [B, Q, H_q, D]
    _write(k_pool, key, slots)
    _write(v_pool, value, slots)
    if attention == "native":
        attend = choose("paged_attention", "cpu", dtype=query.dtype).fn
    elif attention == "triton":
        attend = triton_paged.paged_attention
    elif attention == "flex":
        attend = flex_paged.paged_attention
    else:
        attend = portable.paged_attention if attention == "portable" else reference.paged_attention
    return attend(query, k_pool, v_pool, block_tables, q_pos, scale, window, softcap, sinks)


def _paged_decode_fake(
    query, key, value, k_pool, v_pool, slots, block_tables, q_pos, scale, window, softcap, attention, sinks=None
):
    b, h, q, d = query.shape  # shapes only, for tracing
    return query.new_empty((b, q, h, d))


def define_paged_op() -> Callable[..., torch.Tensor]:
    """Define ``torch.ops.hf_accel.paged_decode`` once per process (called at patch time, never at import)."""
    schema = (
        "(Tensor query, Tensor key, Tensor value, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
        "Tensor block_tables, Tensor q_pos, float scale, int window, float softcap, str attention, "
        "Tensor? sinks=None) -> Tensor"
    )
    return define_composite("paged_decode", schema, _paged_decode, _paged_decode_fake)
