"""Device-generic implementations of the native entry points, for devices without a native build (CUDA, XPU, MPS).

Where :mod:`.reference` is written to be obviously right (per-row loops, host-side position lists), these are
written for accelerators: whole-batch tensor operations with every index on the device, so a call issues a fixed
sequence of kernels, never waits for the device (no ``.item()``, ``.tolist()``, ``nonzero`` or boolean indexing),
and can be captured in a CUDA graph or traced by ``torch.compile`` without a graph break. Results equal the
reference's up to float rounding order; tests hold them to it on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import sink_softmax

__all__ = [
    "WHY",
    "chunk_attention",
    "int8_experts_linear",
    "int8_linear",
    "int8_linear_compiled",
    "paged_attention",
    "pool_write",
]

#: what :func:`hf_accel.kernels.ops.choose` says of each portable implementation when it picks it
WHY = {
    "paged_attention": "whole-batch attention over the pool with device-side block tables (no host sync, CUDA-graph "
    "safe)",
    "int8_experts_linear": "up to 64 (row, expert) pairs: each pair's int8 weights gathered and de-quantized, one "
    "batched matmul (no host sync); above: the pairs grouped by expert after one host read, a matmul per expert hit",
    "int8_linear": "int8 weights de-quantized in the input dtype, then the device's matmul (a compiled step fuses the "
    "de-quantization)",
}


def _gather_context(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Every row's blocks, in order: pool ``[NB, BS, H_kv, D]``, tables ``[B, MB]`` -> ``[B, H_kv, MB*BS, D]``.

    Table entries past a row's last block may hold anything (``-1``, stale ids): they are clamped into the pool
    and masked by the caller."""
    batch, width = block_tables.shape
    index = block_tables.long().clamp(0, pool.shape[0] - 1).flatten()  # [B*MB]
    blocks = pool.index_select(0, index)  # [B*MB, BS, H_kv, D]
    return blocks.view(batch, width * pool.shape[1], *pool.shape[2:]).transpose(1, 2)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[B, Q, S]`` bool: query at ``q_pos`` ``[B, Q]`` sees key at ``k_pos`` ``[B, S]`` (``-1``: no key) when
    ``0 <= k_pos <= q_pos`` (and ``k_pos > q_pos - window``).

    A query that sees nothing (padding, ``q_pos < 0``) is given key 0 alone, so its softmax stays finite; the caller
    zeroes its output."""
    pos, keys = q_pos.long()[..., None], k_pos.long()[:, None, :]  # [B, Q, 1], [B, 1, S]
    visible = (keys >= 0) & (keys <= pos)
    if window > 0:
        visible &= keys > pos - window
    first = torch.arange(k_pos.shape[1], device=k_pos.device) == 0  # [S]
    return visible | (~visible.any(-1, keepdim=True) & first)


def _attend(
    query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
    window: int, softcap: float, sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """``query`` ``[B, H_q, Q, D]`` over finite ``k`` / ``v`` ``[B, H_kv, S, D]`` with token positions ``q_pos``
    ``[B, Q]`` / ``k_pos`` ``[B, S]`` (-1: padding) and attention ``sinks`` ``[H_q]`` (or ``None``) -> ``[B, Q, H_q,
    D]``, zeros for padding queries."""
    batch, heads, q_len, dim = query.shape
    kv_heads, length = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    visible = _visible(q_pos, k_pos, window)  # [B, Q, S]
    # grouped heads share their K/V: query head h reads K/V head h // groups
    q = query.reshape(batch, kv_heads, groups * q_len, dim)  # [B, H_kv, G*Q, D]
    mask = visible[:, None, None].expand(batch, 1, groups, q_len, length).reshape(batch, 1, groups * q_len, length)
    if softcap > 0 or sinks is not None:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H_kv, G*Q, S]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        # sinks: query head kvh * G + g at tile row g * Q + j -> [1, H_kv, G*Q, 1]
        sink = None if sinks is None else sinks.view(kv_heads, groups, 1).expand(-1, -1, q_len)
        sink = None if sink is None else sink.reshape(1, kv_heads, groups * q_len, 1)
        probs = sink_softmax(scores.masked_fill(~mask, float("-inf")), sink)
        out = torch.matmul(probs, v.float()).to(query.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, H_kv, G*Q, D]
    out = out.view(batch, heads, q_len, dim).transpose(1, 2)  # [B, Q, H_q, D]
    return torch.where((q_pos >= 0)[..., None, None], out, 0)


def paged_attention(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_pos: torch.Tensor,
    scale: float, window: int, softcap: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention over a block pool for the whole batch at once (the arguments and result of
    :func:`hf_accel.kernels.reference.paged_attention`).

    Shapes: query ``[B, H_q, Q, D]``; pools ``[NB, BS, H_kv, D]``; block_tables ``[B, MB]``; q_pos ``[B, Q]``
    (-1 = padding, which gets zeros). Returns ``[B, Q, H_q, D]``. Every row reads its ``MB * BS`` table slots (the
    widest row's context); keys past a query's position are masked.
    """
    k = _gather_context(k_pool, block_tables).to(query.dtype)  # [B, H_kv, S, D]
    v = _gather_context(v_pool, block_tables).to(query.dtype)
    # slots past a row's last query were never written (or hold another sequence's tokens, or a pool's uninitialised
    # memory): zero them, since a masked score times a NaN value would still be NaN (and so would a multiply by 0)
    t = torch.arange(k.shape[2], device=q_pos.device)  # [S]
    stored = t <= q_pos.amax(dim=1, keepdim=True)  # [B, S]
    k = torch.where(stored[:, None, :, None], k, 0)
    v = torch.where(stored[:, None, :, None], v, 0)
    return _attend(query, k, v, q_pos, torch.where(stored, t, -1), scale, window, softcap, sinks)


def chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_pos: torch.Tensor, scale: float, window: int,
    softcap: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """A batch of fresh prompts (nothing stored before this chunk) attending over their own tokens in one call.

    Shapes: query ``[B, H_q, Q, D]``; key / value ``[B, H_kv, Q, D]``; q_pos ``[B, Q]`` (each token's index in its
    sequence, -1 = padding: neither a query nor a key). Returns ``[B, Q, H_q, D]`` (zeros for padding).
    """
    return _attend(query, key.to(query.dtype), value.to(query.dtype), q_pos, q_pos, scale, window, softcap, sinks)


def pool_write(pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``new`` (``[B, H_kv, Q, D]``) at ``slots`` (``[B*Q]`` int64, row-major; ``-1`` = not stored) of
    ``pool`` (``[NB, BS, H_kv, D]``), without reading ``slots`` on the host.

    A token that is not stored is written where the first stored token goes, with that token's values (an
    identical duplicate write); when no token is stored, slot 0 is written with its own values."""
    flat = pool.view(-1, *pool.shape[2:])  # [NB*BS, H_kv, D]
    rows = new.transpose(1, 2).reshape(-1, *pool.shape[2:]).to(pool.dtype)  # [B*Q, H_kv, D]
    keep = slots >= 0  # [N]
    first = torch.argmax(keep.to(torch.int8)).view(1)  # [1]: the first stored token (0 when there is none)
    anyone = keep.any()
    anchor_slot = torch.where(anyone, slots.index_select(0, first), 0)  # [1]
    anchor_row = torch.where(anyone, rows.index_select(0, first), flat[:1])  # [1, H_kv, D]
    index = torch.where(keep, slots, anchor_slot)
    source = torch.where(keep[:, None, None], rows, anchor_row)
    flat.index_copy_(0, index, source)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 on an accelerator without a kernel of ours: ``x [M, K]`` @ ``(qweight [N, K] int8 *
    scale [N, G])^T`` -> ``[M, N]`` in ``x``'s dtype, through a de-quantized copy of the weight in ``x``'s dtype (the
    compiled step fuses it: :func:`int8_linear_compiled`). PyTorch's ``torch._weight_int8pack_mm`` is not used: its
    CUDA kernel runs one thread per output with uncoalesced weight reads."""
    return int8_linear_compiled(x, qweight, scale)


def int8_linear_compiled(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The form of :func:`int8_linear` for a compiled step: plain ops whose de-quantization Inductor fuses into the
    matmul's loads (the int8 weight is what is read). ``x [M, K]`` -> ``[M, N]`` in ``x``'s dtype."""
    n, k = qweight.shape
    if scale.shape[1] == 1:  # int8 values are exact in bfloat16 / float16: scale the sums, not the weights
        return F.linear(x, qweight.to(x.dtype)) * scale.view(-1).to(x.dtype)
    groups = scale.shape[1]
    weight = (qweight.view(n, groups, k // groups).to(x.dtype) * scale.to(x.dtype)[..., None]).view(n, k)
    return F.linear(x, weight)


#: up to this many (row, expert) pairs :func:`int8_experts_linear` gathers each pair's weights (no host sync)
EXPERTS_GATHER_PAIRS = 64


def int8_experts_linear(
    x: torch.Tensor, expert_ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """A mixture of experts' int8 linear on an accelerator (:func:`hf_accel.kernels.reference.int8_experts_linear`):
    ``x [R, K]``, ``expert_ids [R, J]``, ``qweight [E, N, K]``, ``scale [E, N, G]`` -> ``[R, J, N]`` in ``x``'s dtype.

    Up to :data:`EXPERTS_GATHER_PAIRS` pairs (decode), or while a CUDA graph is being captured, each pair's weights
    are gathered and de-quantized and one batched matmul runs: no host sync. More pairs (prefill) are grouped by
    expert after one host read of the counts (the gathered copies would outgrow the experts themselves). On CUDA
    the Triton kernel (:mod:`hf_accel.kernels.triton_experts`) runs instead where Triton loads."""
    num_experts, n, k = qweight.shape
    rows, j = expert_ids.shape
    flat = expert_ids.reshape(-1)  # [P]
    valid = (flat >= 0) & (flat < num_experts)  # [P]
    safe = torch.where(valid, flat, 0)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if flat.numel() <= EXPERTS_GATHER_PAIRS or capturing:
        groups = scale.shape[2]
        w = qweight[safe].view(-1, n, groups, k // groups).to(x.dtype) * scale[safe].to(x.dtype)[..., None]
        xs = x.repeat_interleave(j, dim=0)  # [P, K]
        y = torch.bmm(w.view(-1, n, k), xs[:, :, None])[..., 0]  # [P, N]
        return (y * valid[:, None]).view(rows, j, n)
    keyed = torch.where(valid, flat, num_experts)  # an invalid id sorts last, after every expert
    order = torch.argsort(keyed, stable=True)  # pairs grouped by expert
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts].tolist()  # the one host read
    out = x.new_zeros(rows * j, n)  # [P, N]
    start = 0
    for expert, count in enumerate(counts):
        if count:
            pairs = order[start : start + count]  # [count]
            out[pairs] = int8_linear_compiled(x[pairs // j], qweight[expert], scale[expert])
        start += count
    return out.view(rows, j, n)
