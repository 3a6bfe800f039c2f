"""Pure-torch references of every native entry point (:mod:`.ops`): same arguments, same results up to float
rounding order, on any device. They are what tests compare the native builds against, and what an op runs where no
native implementation applies (:func:`.ops.choose` says when, and the feature reports it).

Activation quantization for the integer-dot kernels: W8A8 quantizes each row to int8 per one of :data:`ACT_LANES`
interleaved feature groups (feature ``k`` belongs to group ``(k % 64) // 4``: the four features one int32 lane of
AVX-512 VNNI's ``vpdpbusd`` sums, as do AVX2's ``vpmaddubsw`` + ``vpmaddwd``); W8A16 to int16 with groups
``(k % 32) // 2`` (``vpdpwssd``; ``vpmaddwd``). The linears are then
exact integer dots per group, scaled once: :func:`w8a8_exact` / :func:`w8a16_exact`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ACT16_BLOCK",
    "ACT_BLOCK",
    "ACT_LANES",
    "CODE_GROUP",
    "HALF_DTYPES",
    "HALF_MAX_ROWS",
    "W8A16_MAX_K",
    "coded_linear",
    "decode_codes",
    "decoder_layers",
    "decoder_layers_paged",
    "dense_attention",
    "dequantize_activations",
    "float_linear",
    "half_linear",
    "int8_experts_linear",
    "int8_linear",
    "paged_attention",
    "panel_linear",
    "panel_pack",
    "quantize_activations",
    "quantize_activations16",
    "sink_softmax",
    "token_slots",
    "vnni_activations",
    "w8a8_exact",
    "w8a8_linear",
    "w8a16_exact",
    "w8a16_fits",
    "w8a16_linear",
]

#: W8A8 needs ``in_features`` to be a multiple of this (one 64-byte vector of int8).
ACT_BLOCK = 64
#: Activation scales per row: group ``l`` holds features ``k`` with ``(k % block) // (block / 16) == l``.
ACT_LANES = 16
#: W8A16: features per block of int16 activations (two per group and block).
ACT16_BLOCK = 32
#: W8A16: the int32 lane sums cannot overflow up to this many input features.
W8A16_MAX_K = 8192


# ------------------------------------------------------------------------------------------- int8 linears
def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Weight-only int8: ``x [M, K]`` float32 @ ``(qweight [N, K] int8 * scale [N, G])^T`` -> ``[M, N]`` float32."""
    n, k = qweight.shape
    weight = (qweight.float().view(n, scale.shape[1], k // scale.shape[1]) * scale.float()[..., None]).view(n, k)
    return x.float() @ weight.T


def int8_experts_linear(
    x: torch.Tensor, expert_ids: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """A mixture of experts' weight-only int8 linear: row ``r`` of ``x [R, K]`` times the weights of each of its experts
    ``expert_ids[r, j]`` (``[R, J]``; an id outside ``[0, E)`` gives zeros): ``qweight [E, N, K]`` int8,
    ``scale [E, N, G]`` -> ``[R, J, N]`` in ``x``'s dtype (float32 sums)."""
    num_experts = qweight.shape[0]
    out = torch.zeros(*expert_ids.shape, qweight.shape[1], dtype=torch.float32, device=x.device)  # [R, J, N]
    for expert in expert_ids.unique().tolist():
        if 0 <= expert < num_experts:
            rows, slots = (expert_ids == expert).nonzero(as_tuple=True)
            out[rows, slots] = int8_linear(x[rows], qweight[expert], scale[expert])
    return out.to(x.dtype)


def _lane_view(x: torch.Tensor, block: int = ACT_BLOCK, scheme: str = "W8A8") -> torch.Tensor:
    """``[M, K]`` -> ``[M, K / block, 16, block / 16]``: dims 1 and 3 of the view run over one activation group."""
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"{scheme} activations must be [M, K] with K a multiple of {block}, got {tuple(x.shape)}")
    return x.reshape(x.shape[0], x.shape[1] // block, ACT_LANES, block // ACT_LANES)


def _quantize_groups(x: torch.Tensor, block: int, top: float, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    groups = _lane_view(x.float(), block, scheme)  # [M, B, 16, block / 16]
    scale = groups.abs().amax(dim=(1, 3)) / top  # [M, 16]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None, :, None]  # zero groups hold zeros
    return torch.round(groups / safe).clamp_(-top, top).reshape(x.shape), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8 activations: ``x [M, K]`` (``K % 64 == 0``) -> ``xq [M, K]`` int8 in ``[-127, 127]`` and ``scale
    [M, 16]`` float32 (``max|group| / 127``; 0 for an all-zero group). Round half to even, as the kernel does."""
    xq, scale = _quantize_groups(x, ACT_BLOCK, 127.0, "W8A8")
    return xq.to(torch.int8), scale


def quantize_activations16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A16 activations: ``x [M, K]`` (``K % 32 == 0``) -> ``xq`` int16 in ``[-32767, 32767]`` and ``scale [M, 16]``
    (``max|group| / 32767``)."""
    xq, scale = _quantize_groups(x, ACT16_BLOCK, 32767.0, "W8A16")
    return xq.to(torch.int16), scale


def dequantize_activations(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 ``xq [M, K]`` int8 and ``scale [M, 16]`` -> ``[M, K]`` float32 (each value times its group's scale)."""
    return (_lane_view(xq).float() * scale[:, None, :, None]).reshape(xq.shape)


def vnni_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the native ``quantize_activations`` returns: ``xq`` int8, ``scale [M, 16]`` and ``base [M, 16]`` int32
    ``= -128 * (sum of xq per group)`` (the start of ``vpdpbusd``'s unsigned-by-signed accumulation)."""
    xq, scale = quantize_activations(x)
    base = -128 * _lane_view(xq).to(torch.int32).sum(dim=(1, 3))  # [M, 16]
    return xq, scale, base.to(torch.int32)


def _exact(
    xq: torch.Tensor, xscale: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, block: int
) -> torch.Tensor:
    if scale.shape[1] != 1:
        raise ValueError(f"integer-dot linears need one weight scale per row, got {scale.shape[1]} per row")
    xg = _lane_view(xq, block).double()  # [M, B, 16, block / 16]
    wg = _lane_view(qweight, block).double()  # [N, B, 16, block / 16]
    dots = torch.einsum("mbla,nbla->mnl", xg, wg)  # [M, N, 16] exact integers (< 2**53)
    return (dots * xscale.double().unsqueeze(1)).sum(-1) * scale.double().reshape(1, -1)


def w8a8_exact(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W8A8 linear in float64: ``sum_l xscale[m, l] * (xq[m, group l] . q[n, group l]) * scale[n]``."""
    xq, xscale = quantize_activations(x)
    return _exact(xq, xscale, qweight, scale, ACT_BLOCK)


def w8a16_exact(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W8A16 linear in float64 (int16 activations, groups of :data:`ACT16_BLOCK`-feature blocks)."""
    xq, xscale = quantize_activations16(x)
    return _exact(xq, xscale, qweight, scale, ACT16_BLOCK)


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8: ``x [M, K]`` -> ``[M, N]`` float32 (:func:`w8a8_exact`, rounded once)."""
    return w8a8_exact(x, qweight, scale).float()


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A16: ``x [M, K]`` -> ``[M, N]`` float32 (:func:`w8a16_exact`, rounded once)."""
    return w8a16_exact(x, qweight, scale).float()


def w8a16_fits(in_features: int, groups: int) -> bool:
    """Whether int8 weights of ``in_features`` columns and ``groups`` scales per row suit W8A16."""
    return groups == 1 and in_features % ACT16_BLOCK == 0 and in_features <= W8A16_MAX_K


# ------------------------------------------------------------------------------------------ float linears
def float_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` float32 @ ``weight [N, K]``^T -> ``[M, N]``."""
    return x @ weight.T


def half_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` float32 @ ``weight [N, K]``^T with a bfloat16 / float16 weight -> ``[M, N]`` float32 (the weight
    widened exactly to float32, float32 sums)."""
    return x @ weight.float().T


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float32 (``N % 16 == 0``) -> ``[N / 16, K, 16]`` panels of 16 output features."""
    n, k = weight.shape
    return weight.contiguous().view(n // 16, 16, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K]`` @ the panel-packed weight ``[N / 16, K, 16]``^T (+ ``bias [N]``) -> ``[M, N]``."""
    panels, k, lanes = packed.shape
    weight = packed.transpose(1, 2).reshape(panels * lanes, k)  # [N, K]
    return F.linear(x, weight, bias)


CODE_GROUP = 32  # weights per (scale, offset) pair of an exact-code weight


def decode_codes(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """An exact-code weight (:mod:`hf_accel.quant.codes`) as float32 ``[N, K]``: ``fl(fl(d * c) + m)`` per element,
    ``(d, m) = params [N, K / 32, 2]`` (float32 or float16), ``c`` from ``codes`` ``[N, K / 2]`` uint8 (4-bit: byte
    ``j`` of a group holds elements ``j`` and ``j + 16``) or ``[N, K]`` int8."""
    n, groups = params.shape[0], params.shape[1]
    if codes.dtype == torch.uint8:
        halves = codes.view(n, groups, CODE_GROUP // 2)
        c = torch.cat((halves & 15, halves >> 4), dim=-1).float()  # [N, G, 32]
    else:
        c = codes.view(n, groups, CODE_GROUP).float()
    params = params.float()  # float16 params widen exactly
    return ((params[..., :1] * c) + params[..., 1:]).view(n, groups * CODE_GROUP)  # two roundings


def coded_linear(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` float32 @ the exact-code weight's float32 values^T -> ``[M, N]``."""
    return x @ decode_codes(codes, params).T


# -------------------------------------------------------------------------------------------- attention
def token_slots(table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Pool slots of a sequence's first ``n`` tokens through its block ``table`` ([blocks]) -> [n] int64."""
    t = torch.arange(n, device=table.device)
    return table.long()[t // block_size] * block_size + t % block_size


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores`` ``[..., S]``, with one more logit per row, ``sinks``
    (broadcast to ``[..., 1]``; ``None``: none), that takes probability but reads no value (GPT-OSS's attention
    sinks). A row with every score ``-inf`` gets all-zero weights when it has a sink."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], -1).softmax(-1)[..., :-1]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], scale: float, window: int = 0,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of queries at token ``positions`` over keys ``0..S-1`` of one sequence.

    Shapes: q ``[H_q, r, D]``; k, v ``[H_kv, S, D]``; sinks ``[H_q]`` or ``None``; returns ``[H_q, r, D]``. Query
    ``i`` sees keys ``t <= positions[i]`` (and ``t > positions[i] - window`` when ``window > 0``); ``softcap > 0``
    applies ``softcap * tanh(score / softcap)`` to the scores; ``sinks`` adds one logit per head to each softmax
    (:func:`sink_softmax`).
    """
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    pos = torch.tensor(positions, device=q.device)[:, None]  # [r, 1]
    t = torch.arange(k.shape[1], device=q.device)[None, :]  # [1, S]
    visible = t <= pos
    if window > 0:
        visible &= t > pos - window
    causal_tail = positions == list(range(k.shape[1] - len(positions), k.shape[1]))
    if softcap <= 0 and sinks is None:  # 4D inputs: the 3D form misses SDPA's fused CPU kernels (math path)
        if causal_tail and window <= 0 and len(positions) == k.shape[1]:
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=scale)[0]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [H, r, S]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = sink_softmax(scores, None if sinks is None else sinks[:, None, None])
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_attention(
    query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor, q_pos: torch.Tensor,
    scale: float, window: int, softcap: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention over a block pool through block tables.

    Shapes: query ``[B, H_q, Q, D]``; pools ``[NB, BS, H_kv, D]``; block_tables ``[B, MB]``; q_pos ``[B, Q]``
    (-1 = padding, which gets zeros); sinks ``[H_q]`` (one more softmax logit per head, reading no value) or
    ``None``. Returns ``[B, Q, H_q, D]``.
    """
    batch, heads, q_len, dim = query.shape
    block = k_pool.shape[1]
    out = query.new_zeros(batch, q_len, heads, dim)
    flat_k, flat_v = k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:])  # [NB*BS, H_kv, D]
    for row in range(batch):
        pos = q_pos[row]
        real = (pos >= 0).nonzero().flatten()
        if real.numel() == 0:
            continue
        slots = token_slots(block_tables[row], int(pos.max()) + 1, block)  # [n]
        k = flat_k.index_select(0, slots).transpose(0, 1)  # [H_kv, n, D]
        v = flat_v.index_select(0, slots).transpose(0, 1)
        o = dense_attention(query[row][:, real], k, v, pos[real].tolist(), scale, window, softcap, sinks)  # [H_q, r, D]
        out[row, real] = o.transpose(0, 1).to(out.dtype)
    return out


# ------------------------------------------------------------------------------------- decoder layers
#: tensors per layer in :func:`decoder_layers`' ``flat`` list, in this order (an absent one is an empty tensor):
#: norms, then each projection as (weight [N, K] int8 or float, int8 scales [N, G], bias [N]), then q/k head norms
LAYER_PARAMS = (
    "ln1", "ln2", "q", "q_scale", "q_bias", "k", "k_scale", "k_bias", "v", "v_scale", "v_bias", "o", "o_scale",
    "o_bias", "gate", "gate_scale", "gate_bias", "up", "up_scale", "up_bias", "down", "down_scale", "down_bias",
    "q_norm", "k_norm",
)  # fmt: skip
#: how :func:`decoder_layers` runs int8 projections: weight-only, or with int16 / int8 activations
WEIGHT_ONLY, W8A16, W8A8 = 0, 1, 2


#: the half-precision weight dtypes ``half_linear`` and the native layers read in place
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: up to this many rows ``half_linear`` takes a call, and the native layers' half-precision projections keep float32
#: activations (its ``kMaxRows``)
HALF_MAX_ROWS = 16


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _project(x: torch.Tensor, p: dict[str, torch.Tensor], name: str, mode: int) -> torch.Tensor:
    weight, scale, bias = p[name], p[f"{name}_scale"], p[f"{name}_bias"]
    if weight.dtype in HALF_DTYPES:  # a half model: float32 sums for few rows, the half GEMM above
        y = x @ weight.float().T if x.shape[0] <= HALF_MAX_ROWS else (x.to(weight.dtype) @ weight.T).float()
    elif scale.dim() == 3:  # exact codes of a float weight
        y = coded_linear(x, weight, scale)
    elif weight.dtype != torch.int8:
        y = x @ weight.T
    elif mode == W8A8:
        y = w8a8_linear(x, weight, scale)
    elif mode == W8A16 and w8a16_fits(weight.shape[1], scale.shape[1]):
        y = w8a16_linear(x, weight, scale)
    else:
        y = int8_linear(x, weight, scale)
    return y + bias if bias.numel() else y


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of ``x [M, heads, D]`` with ``cos / sin [M, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float):
    """``q [B, H, C, D]`` over ``keys / values [B, H_kv, T, D]`` where ``allowed [B, C, T]``; zeros for a query that
    sees nothing. Returns ``[B, C, H * D]``."""
    groups = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(groups, 1), values.float().repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scaling  # [B, H, C, T]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))  # a row of -inf gives NaNs: zeros
    out = probs @ v  # [B, H, C, D]
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _store(buffer: torch.Tensor, new: torch.Tensor, used: int) -> None:
    """Write ``new [B, H_kv, C, D]`` float32 into columns ``[used, used + C)`` (float16 saturates, never inf)."""
    if buffer.dtype == torch.float16:
        new = new.clamp(-65504.0, 65504.0)
    buffer[:, :, used : used + new.shape[2]] = new.to(buffer.dtype)


def _run_layers(
    h: torch.Tensor, flat: list[torch.Tensor], layers: int, cos: torch.Tensor, sin: torch.Tensor, heads: int,
    kv_heads: int, eps: float, mode: int, attend: Any,
) -> torch.Tensor:  # fmt: skip
    """Every layer on ``h [M, E]``; ``attend(layer, q [M, H, D], k / v [M, H_kv, D]) -> [M, H * D]`` stores the
    layer's K/V and attends."""
    dim = cos.shape[1]
    x = h.float().clone()  # [M, E]
    for layer in range(layers):
        p = dict(zip(LAYER_PARAMS, flat[layer * len(LAYER_PARAMS) : (layer + 1) * len(LAYER_PARAMS)], strict=True))
        normed = _rms(x, p["ln1"], eps)
        q = _project(normed, p, "q", mode).view(-1, heads, dim)  # [M, H, D]
        k = _project(normed, p, "k", mode).view(-1, kv_heads, dim)  # [M, H_kv, D]
        v = _project(normed, p, "v", mode).view(-1, kv_heads, dim)
        if p["q_norm"].numel():
            q, k = _rms(q, p["q_norm"], eps), _rms(k, p["k_norm"], eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + _project(attend(layer, q, k, v), p, "o", mode)
        normed = _rms(x, p["ln2"], eps)
        if p["up"].numel():
            gate, up = _project(normed, p, "gate", mode), _project(normed, p, "up", mode)
        else:
            gate, up = _project(normed, p, "gate", mode).chunk(2, dim=-1)
        x = x + _project(F.silu(gate) * up, p, "down", mode)
    return x


def decoder_layers(
    h: torch.Tensor, flat: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], used: int,
    allowed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
    scaling: float, mode: int,
) -> torch.Tensor:  # fmt: skip
    """Llama-family decoder layers over a chunk, writing each layer's K/V into its buffers.

    Args:
        h: ``[B*C, E]`` float32 hidden states, rows b-major.
        flat: :data:`LAYER_PARAMS` tensors per layer, layer after layer.
        keys / values: per layer ``[B, H_kv, cap, D]`` (float32 or float16) holding ``used`` columns; the chunk's are
            written at ``[used, used + C)``.
        allowed: ``[B, C, used + C]`` bool: which columns each query sees.
        cos / sin: ``[B*C, D]`` rotary tables.
        heads / kv_heads / eps / scaling: attention heads, K/V heads, RMSNorm epsilon, softmax scale.
        mode: how int8 projections run (:data:`WEIGHT_ONLY`, :data:`W8A16`, :data:`W8A8`).

    Returns:
        ``[B*C, E]`` hidden states after the last layer (a query that sees nothing attends to zeros).
    """
    batch, width, total = allowed.shape
    dim = cos.shape[1]

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _store(keys[layer], k.view(batch, width, kv_heads, dim).transpose(1, 2), used)
        _store(values[layer], v.view(batch, width, kv_heads, dim).transpose(1, 2), used)
        queries = q.view(batch, width, heads, dim).transpose(1, 2)  # [B, H, C, D]
        kv = keys[layer][:, :, :total], values[layer][:, :, :total]
        return _attend(queries, *kv, allowed, scaling).reshape(-1, heads * dim)

    return _run_layers(h, flat, len(keys), cos, sin, heads, kv_heads, eps, mode, attend)


def decoder_layers_paged(
    h: torch.Tensor, flat: list[torch.Tensor], k_pools: list[torch.Tensor], v_pools: list[torch.Tensor],
    slots: torch.Tensor, block_tables: torch.Tensor, q_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    heads: int, kv_heads: int, eps: float, scaling: float, mode: int,
) -> torch.Tensor:  # fmt: skip
    """:func:`decoder_layers` over a paged pool: token ``m`` of the chunk is stored at ``slots[m]`` (``[B*C]``, -1:
    not stored) of each layer's ``[NB, BS, H_kv, D]`` pools, and attends through ``block_tables [B, MB]`` with
    ``q_pos [B, C]`` (-1: a padding query, which gets zeros) as :func:`paged_attention`. Returns ``[B*C, E]``."""
    batch, width = q_pos.shape
    dim = cos.shape[1]
    stored = (slots >= 0).nonzero().flatten()

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for pool, new in ((k_pools[layer], k), (v_pools[layer], v)):
            pool.view(-1, kv_heads, dim).index_copy_(0, slots[stored], new[stored].to(pool.dtype))
        queries = q.view(batch, width, heads, dim).transpose(1, 2)  # [B, H, C, D]
        out = paged_attention(queries, k_pools[layer], v_pools[layer], block_tables, q_pos, scaling, 0, 0.0)
        return out.reshape(-1, heads * dim)  # [B*C, H*D]

    return _run_layers(h, flat, len(k_pools), cos, sin, heads, kv_heads, eps, mode, attend)
