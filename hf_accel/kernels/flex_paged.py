"""Paged decode attention through PyTorch's FlexAttention: the third candidate on CUDA, beside the Triton kernel of
:mod:`.triton_paged` and the portable gather-then-SDPA of :mod:`.portable` (``PagedConfig(attention="flex")``).

FlexAttention takes K/V as ``[B_kv, H_kv, S, D]`` and a block mask that lists, for each query row, which ``S``
blocks it reads. The pool ``[NB, BS, H_kv, D]`` is viewed in place as one sequence of ``NB * BS`` slots (``B_kv = 1``,
broadcast to every row); each row's block mask lists its table's live blocks (``kv_indices``, physical block ids,
the KV block size is the pool's), so the fused kernel reads each row's blocks straight from the pool. A mask function
maps a physical slot back to the row's token position through the inverse table and keeps ``0 <= position <=
query position`` (and the sliding window); Gemma-2's soft-capping is a score function. Every index is built on the
device from the block table and positions: no host sync, so the step can be captured in a CUDA graph.

The fused kernel reads whole KV blocks, a row's partial last block included, and a masked score times a NaN value is
still NaN: the pools this attention reads are zero-filled when they are allocated (``PagedLayer``), so a slot that
was never written holds 0 and a stale one a finite value.

Inductor compiles FlexAttention to Triton on CUDA (dynamic shapes: one compile for every batch, chunk and pool size).
Its C++ lowering for the CPU fails on dynamic query lengths (torch 2.13), so this module does not run on the CPU in
real use (:func:`why_not`); the tests run :func:`make_paged_attention` with the uncompiled ``flex_attention`` (which
materialises scores over the whole pool: fine for a test's pool) and with a static-shape compile.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import FeatureNotAvailableError

__all__ = [
    "COMPILED",
    "DEVICES",
    "WHY",
    "block_mask",
    "compile_flex",
    "make_paged_attention",
    "paged_attention",
    "why_not",
]

#: what :func:`hf_accel.paged.attention.attention_choice` says of this implementation
WHY = "PagedCache(attention='flex') asked for it: FlexAttention compiled by Inductor, reading the pool in place"

#: devices whose Inductor lowers FlexAttention with dynamic shapes (Triton)
DEVICES = ("cuda", "xpu")

#: query tile of the block mask: a decode-sized chunk (at most 16 queries) is one tile
_Q_BLOCK = 128


def _flex() -> tuple[Callable[..., Any], type] | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:  # torch < 2.5
        return None
    return flex_attention, BlockMask


def _flex_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Callable[..., Any] | None,
    block_mask: Any, scale: float, enable_gqa: bool, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``flex_attention`` behind a code object of this module's: what :func:`compile_flex` compiles, so the compile
    cache and recompile budget are ours, not shared with a user's own ``torch.compile(flex_attention)``.

    ``sinks`` ``[H_q]`` (GPT-OSS's attention sinks) join each head's softmax as one more logit that reads no value:
    with ``lse`` the log of the scores' softmax denominator, the output scales by ``1 / (1 + exp(sink - lse))``."""
    flex_attention, _ = _flex()  # type: ignore[misc]
    if sinks is None:
        return flex_attention(
            query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
        )
    out, lse = flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
        **_lse_kwargs(),
    )  # fmt: skip
    lse = lse if isinstance(lse, torch.Tensor) else lse.lse  # out: [B, H_q, Q, D]; lse: [B, H_q, Q]
    keep = torch.sigmoid(lse - sinks.float()[None, :, None])  # a row with nothing visible: lse = -inf -> 0
    return (out.float() * keep[..., None]).to(out.dtype)


@functools.cache
def _lse_kwargs() -> dict[str, Any]:
    """How this torch's ``flex_attention`` returns the log-sum-exp (``return_aux`` from torch 2.9, else
    ``return_lse``)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def compile_flex(dynamic: bool) -> Callable[..., torch.Tensor]:
    """FlexAttention compiled by Inductor (``dynamic``: one compile for every batch, chunk and pool size), with
    ``fullgraph=True``: past torch.compile's recompile limit, an error instead of the uncompiled function (which
    would score every slot of the pool). For :func:`make_paged_attention`."""
    return torch.compile(_flex_call, dynamic=dynamic, fullgraph=True)


def why_not(device: torch.device) -> str | None:
    """Why FlexAttention paged decode cannot run on ``device`` (``None``: it can)."""
    if device.type not in DEVICES:
        return (
            f"FlexAttention over the pool is compiled with dynamic shapes, which Inductor lowers for "
            f"{'/'.join(DEVICES)} (Triton), not for {device.type} (its C++ lowering fails on dynamic query lengths); "
            f"use attention='auto' (on the CPU: the native kernel) or 'batched'"
        )
    if _flex() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if importlib.util.find_spec("triton") is None:
        return "Inductor needs triton to compile FlexAttention, and it is not installed"
    return None


@functools.cache
def _from_kv_blocks_kwargs(block_mask_cls: type) -> dict[str, Any]:
    """``compute_q_blocks=False`` where this torch has it (the backward's transposed indices are not needed)."""
    params = inspect.signature(block_mask_cls.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in params else {}


def block_mask(block_tables: torch.Tensor, q_pos: torch.Tensor, num_blocks: int, block_size: int, window: int) -> Any:
    """The :class:`BlockMask` of a chunk over a pool of ``num_blocks`` blocks of ``block_size`` slots.

    ``block_tables`` ``[B, MB]`` (entries past a row's last block may hold anything), ``q_pos`` ``[B, Q]`` (-1:
    padding). Row ``b`` reads its first ``ceil((max(q_pos[b]) + 1) / block_size)`` table blocks; within them, the
    query at position ``p`` sees the slots holding positions ``0..p`` (and ``> p - window``)."""
    _, block_mask_cls = _flex()  # type: ignore[misc]
    batch, width = block_tables.shape
    q_len = q_pos.shape[1]
    device = block_tables.device
    pos = q_pos.to(torch.int32).contiguous()  # [B, Q]
    stored = pos.amax(dim=1) + 1  # [B] tokens each row holds (its last query's position + 1; 0 for padding rows)
    used = torch.div(stored + block_size - 1, block_size, rounding_mode="floor").clamp(0, width)  # [B]
    col = torch.arange(width, device=device, dtype=torch.int32)  # [MB]
    live = col[None, :] < used[:, None]  # [B, MB]
    tables = torch.where(live, block_tables.to(torch.int32), 0)  # [B, MB]: dead entries point at block 0, unread
    # the block mask's KV extent must cover the whole pool: indices padded to NB columns (only the first `used` read)
    kv_indices = torch.nn.functional.pad(tables, (0, max(num_blocks - width, 0)))[:, :num_blocks]  # [B, NB]
    # physical block -> this row's logical block (-1: not the row's); dead entries land in a spare column
    logical = torch.full((batch, num_blocks + 1), -1, dtype=torch.int32, device=device)  # [B, NB + 1]
    target = torch.where(live, block_tables.long().clamp(0, num_blocks - 1), num_blocks)  # [B, MB]
    logical.scatter_(1, target, col[None, :].expand(batch, width).contiguous())
    logical = logical[:, :num_blocks]  # [B, NB]

    # indexed by tensors only: the chunk's and the pool's sizes stay out of the closure (no recompile as they change)
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block = logical[b, kv // block_size]
        token = block * block_size + kv % block_size
        p = pos[b, q]
        seen = (block >= 0) & (p >= 0) & (token <= p)
        if window > 0:
            seen = seen & (token > p - window)
        return seen

    return block_mask_cls.from_kv_blocks(
        used.to(torch.int32)[:, None, None], kv_indices[:, None, None, :], BLOCK_SIZE=(_Q_BLOCK, block_size),
        mask_mod=mask_mod, seq_lengths=(q_len, num_blocks * block_size), **_from_kv_blocks_kwargs(block_mask_cls),
    )  # fmt: skip


def _softcap_mod(softcap: float) -> Callable[..., torch.Tensor] | None:
    if softcap <= 0:
        return None

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def make_paged_attention(flex: Callable[..., Any] | None = None) -> Callable[..., torch.Tensor]:
    """Paged attention with the arguments and result of :func:`hf_accel.kernels.reference.paged_attention`, through
    ``flex`` (called as ``flex(query, key, value, score_mod, block_mask, scale, enable_gqa, sinks)``:
    :func:`compile_flex`'s result; ``None``: the uncompiled ``flex_attention``, for tests on small pools)."""
    flex = flex or _flex_call

    def paged_attention(
        query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
        q_pos: torch.Tensor, scale: float, window: int, softcap: float, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        # query: [B, H_q, Q, D]; pools: [NB, BS, H_kv, D]; block_tables: [B, MB]; q_pos: [B, Q]; sinks: [H_q]
        # -> [B, Q, H_q, D]
        nb, bs, kv_heads, dim = k_pool.shape
        k = k_pool.view(1, nb * bs, kv_heads, dim).transpose(1, 2)  # [1, H_kv, NB*BS, D], the pool in place
        v = v_pool.view(1, nb * bs, kv_heads, dim).transpose(1, 2)
        mask = block_mask(block_tables, q_pos, nb, bs, int(window))
        out = flex(query, k, v, _softcap_mod(float(softcap)), mask, float(scale), query.shape[1] != kv_heads, sinks)
        # out: [B, H_q, Q, D]
        return torch.where((q_pos >= 0)[:, :, None, None], out.transpose(1, 2), 0)

    return paged_attention


#: device type -> its compiled paged attention, built on first use (tests put the uncompiled one here for the CPU)
COMPILED: dict[str, Callable[..., torch.Tensor]] = {}
_lock = threading.Lock()


def _compiled_for(device_type: str) -> Callable[..., torch.Tensor]:
    with _lock:
        if device_type not in COMPILED:
            COMPILED[device_type] = make_paged_attention(compile_flex(dynamic=True))
        return COMPILED[device_type]


def paged_attention(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_pos: torch.Tensor,
    scale: float, window: int, softcap: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """FlexAttention paged decode, compiled for the query's device (arguments and result of
    :func:`hf_accel.kernels.reference.paged_attention`); :func:`why_not` says where it runs."""
    fn = _compiled_for(query.device.type)
    try:
        return fn(query, k_pool, v_pool, block_tables, q_pos, scale, window, softcap, sinks)
    except Exception as err:
        if type(err).__name__ != "FailOnRecompileLimitHit":
            raise
        raise FeatureNotAvailableError(
            "PagedCache(attention='flex'): FlexAttention reached torch.compile's recompile limit in this process "
            "(torch._dynamo.config.recompile_limit: too many models, dtypes or soft-capping variants); use "
            "attention='auto' (the Triton kernel)"
        ) from err
