"""Symmetric weight-only int8 quantization: pure tensor maths, no transformers import.

A weight ``W: [N, K]`` is stored as ``q: [N, K] int8`` and ``scale: [N, G] float32`` with ``G = K / group``
(``G = 1``: one scale per output row). ``W ≈ q * scale`` broadcast over each group of ``group`` columns;
``scale = max|W_group| / 127`` so ``q ∈ [-127, 127]`` and dequantization is exact arithmetic on (q, scale).

W8A8 (``Int8Config(activations="int8")``) also quantizes the activations with the same rule, per row and per
one of :data:`ACT_LANES` interleaved feature groups: feature ``k`` belongs to group ``(k % 64) // 4``, i.e. four
adjacent features of every 64-feature block (the features one int32 lane of AVX-512 VNNI's ``vpdpbusd`` sums, and
of AVX2's ``vpmaddubsw`` + ``vpmaddwd``, so a kernel accumulates each group in integers over the whole row and scales
once at the end). The linear becomes integer dot products per group (:func:`w8a8_reference` is the exact definition
the kernel reproduces).

W8A16 (the speculative draft's native steps) quantizes activations to int16 the same way, per
row and per interleaved group, with groups of two adjacent features of every 32-feature block (what one int32 lane
of ``vpdpwssd`` sums): :func:`quantize_activations16`, :func:`w8a16_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.reference import (
    ACT16_BLOCK,
    ACT_BLOCK,
    ACT_LANES,
    dequantize_activations,
    quantize_activations,
    quantize_activations16,
    w8a8_exact,
    w8a16_exact,
)

__all__ = [
    "ACT16_BLOCK",
    "ACT_BLOCK",
    "ACT_LANES",
    "QuantError",
    "QuantizedWeight",
    "dequantize",
    "dequantize_activations",
    "dequantize_rows",
    "quantization_error",
    "quantize",
    "quantize_activations",
    "quantize_activations16",
    "w8a8_reference",
    "w8a16_reference",
]


@dataclass(frozen=True)
class QuantizedWeight:
    """An int8 weight and its scales.

    Args:
        qweight: ``[N, K]`` int8.
        scale: ``[N, G]`` float32, ``G = K // group_size``.
        group_size: columns sharing one scale (``K`` for per-channel).
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    def nbytes(self) -> int:
        """Bytes held by the int8 values and the scales."""
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()


def _groups(weight: torch.Tensor, group_size: int | None) -> int:
    if weight.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight [out_features, in_features], got {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"quantize expects a floating-point weight, got {weight.dtype}")
    k = weight.shape[1]
    size = k if group_size is None else group_size
    if size < 1 or k % size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    return size


def quantize(
    weight: torch.Tensor, group_size: int | None = None, absmax: torch.Tensor | None = None
) -> QuantizedWeight:
    """Quantize ``weight: [N, K]`` to int8 per output row, or per group of ``group_size`` input columns.

    Args:
        absmax: ``[N, G]`` magnitudes to scale by instead of the weight's own (a shard of a row that must be
            quantized like the whole row: tensor parallelism); each must be ``>=`` the shard's.

    Raises:
        ValueError: not 2-D, ``group_size`` does not divide ``K``, or ``absmax`` of the wrong shape.
        TypeError: not a floating-point tensor.
    """
    size = _groups(weight, group_size)
    n, k = weight.shape
    if absmax is not None and tuple(absmax.shape) != (n, k // size):
        raise ValueError(f"absmax must be [{n}, {k // size}], got {tuple(absmax.shape)}")
    q = torch.empty(n, k, dtype=torch.int8, device=weight.device)  # [N, K]
    scale = torch.empty(n, k // size, dtype=torch.float32, device=weight.device)  # [N, G]
    rows = max(1, _CHUNK // k)  # row blocks keep the float temporaries small (quantizing while loading)
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        amax = None if absmax is None else absmax[part]
        q[part], scale[part] = _quantize_rows(weight[part], size, amax)
    return QuantizedWeight(q, scale, size)


#: elements per block of rows :func:`quantize` works on at once (float32 temporaries of ~16 MiB)
_CHUNK = 1 << 22


def _quantize_rows(weight: torch.Tensor, size: int, absmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [n, K]`` -> int8 ``[n, K]`` and float32 scales ``[n, K // size]`` (row-wise maths: blocks of rows
    give the same values as the whole matrix)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // size, size)  # [n, G, group]
    if absmax is None:
        absmax = w.abs().amax(dim=-1)  # [n, G]
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))  # all-zero groups: any scale
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` for any leading shape: ``q [..., K]`` int8, ``scale [..., G]`` -> ``[..., K]`` of ``dtype``."""
    groups = q.reshape(*q.shape[:-1], scale.shape[-1], group_size).float()  # [..., G, group]
    return (groups * scale.unsqueeze(-1)).reshape(q.shape).to(dtype)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` as a dense ``[N, K]`` tensor of ``dtype``."""
    return dequantize_rows(qw.qweight, qw.scale, qw.group_size, dtype)


def w8a8_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The W8A8 linear, exactly: ``sum_l xscale[m, l] * (xq[m, group l] . q[n, group l]) * wscale[n]`` in float64.

    Args:
        x: ``[M, K]`` float activations.
        qw: a weight with one scale per row (``group_size == K``).

    Returns:
        ``[M, N]`` float64 (the integer dots are exact; the kernel's float32 sums approach this).

    Raises:
        ValueError: more than one scale per weight row, or ``K`` not a multiple of :data:`ACT_BLOCK`.
    """
    if qw.scale.shape[1] != 1:
        raise ValueError(f"W8A8 needs one weight scale per row, got group_size {qw.group_size}")
    return w8a8_exact(x, qw.qweight, qw.scale)


def w8a16_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The W8A16 linear, exactly (int16 activations; see :func:`w8a8_reference`), ``[M, N]`` float64.

    Raises:
        ValueError: more than one scale per weight row, or ``K`` not a multiple of :data:`ACT16_BLOCK`.
    """
    if qw.scale.shape[1] != 1:
        raise ValueError(f"W8A16 needs one weight scale per row, got group_size {qw.group_size}")
    return w8a16_exact(x, qw.qweight, qw.scale)


@dataclass(frozen=True)
class QuantError:
    """Error of a quantized weight against the original.

    Args:
        max_abs: largest absolute element error.
        rel_fro: ``||W - deq(q)||_F / ||W||_F``.
        sqnr_db: signal-to-quantization-noise ratio in dB.
    """

    max_abs: float
    rel_fro: float
    sqnr_db: float


def quantization_error(weight: torch.Tensor, qw: QuantizedWeight) -> QuantError:
    """Error statistics of ``qw`` against the float ``weight`` it came from."""
    w = weight.detach().float()
    diff = w - dequantize(qw)
    noise = diff.pow(2).sum().item()
    signal = w.pow(2).sum().item()
    rel = (noise / signal) ** 0.5 if signal > 0 else 0.0
    sqnr = float("inf") if noise == 0 else 10.0 * torch.log10(torch.tensor(signal / noise)).item()
    return QuantError(diff.abs().max().item(), rel, sqnr)
