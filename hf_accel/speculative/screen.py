"""Greedy verification's LM head through an int8 screen: pure tensor code, no Transformers.

Greedy verification needs only the argmax of the target's logits at every position of a chunk, yet a float32
head computes all ``V`` of them: on SmolLM2 (49152 x 576) ~28 ms for a 4 x 13 chunk, ~15% of the chunk's
forward (one-off timing, docs/speculative.md). :class:`HeadScreen` finds the same argmax for less:

1. ``approx = W8A16(h)``: every logit from an int8 copy of the head weight (one scale per row) and int16
   activations (the integer-dot kernel of the draft's native layers; ~9 ms for 52 rows, VNNI).
2. A rigorous bound on each approximate logit's error: with ``W = Q + R`` (``Q`` the de-quantized int8 weight,
   ``R`` the rounding residual, whose row norms are stored) and ``h = ĥ + e`` (``ĥ`` the int16 activations),
   ``h.W_v - ĥ.Q_v = h.R_v + e.Q_v``, so by Cauchy-Schwarz
   ``|exact - approx| <= ||h|| ||R_v|| + ||e|| ||Q_v||`` with ``||e|| <= sqrt(E) max|h| / 65534`` (each
   activation rounded to its group's step ``max|group| / 32767``), plus a float32 rounding allowance.
3. A token can be the argmax only if its upper bound reaches the best lower bound. Those candidates (usually
   1-3 per position on SmolLM2's generated text, a few dozen at most) get their logits recomputed in float32
   from the float weight, and the argmax among them is returned.

So the result is the argmax of float32 logits over a set that provably holds the real-valued argmax: what the
full head gives, up to float32 summation order between two logits equal to ~1e-6 (the same caveat as scoring a
chunk in one matrix product rather than one token at a time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["HeadScreen"]

#: int16 activations: a group's step is ``max|group| / ACT16_MAX`` (``quant.core.quantize_activations16``)
ACT16_MAX = 32767.0
#: float32 rounding allowance, relative to ``||h|| ||Q_v||`` (a bound on ``sum |h_k Q_vk|``): covers the kernel's
#: float32 scaling and lane sums and the float32 recomputation of the candidates for any ``E`` up to ~10**4
ROUNDING = 1e-3

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadScreen:
    """An LM head's argmax through an int8 screen (module docstring).

    Build it with :meth:`build`. Side effect-free; holds the int8 copy (``V x E`` bytes) and two ``[V]`` norms.

    Args:
        weight: ``[V, E]`` float32, the head's own weight (not copied).
        bias: ``[V]`` float32 or ``None``.
        qweight: ``[V, E]`` int8, ``scale``: ``[V, 1]`` float32: ``Q = qweight * scale``.
        residual: ``[V]`` ``||W_v - Q_v||``, rounded up.
        qnorm: ``[V]`` ``||Q_v||``, rounded up.
        kernel: ``(h [M, E] float32, qweight, scale) -> [M, V]`` float32, W8A16 (int16 activations per row and
            group, step at most ``max|h_m| / 32767``).
    """

    weight: torch.Tensor = field(repr=False)
    bias: torch.Tensor | None = field(repr=False)
    qweight: torch.Tensor = field(repr=False)
    scale: torch.Tensor = field(repr=False)
    residual: torch.Tensor = field(repr=False)
    qnorm: torch.Tensor = field(repr=False)
    kernel: Kernel = field(repr=False)

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Kernel) -> HeadScreen:
        """Quantize ``weight [V, E]`` (float32, finite) per row and measure its residual.

        Raises:
            ValueError: ``weight`` is not a finite 2-D float32 tensor.
        """
        if weight.ndim != 2 or weight.dtype != torch.float32 or not bool(torch.isfinite(weight).all()):
            raise ValueError("HeadScreen needs a finite 2-D float32 weight")
        w = weight.detach()
        scale = (w.abs().amax(1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)  # [V, 1]
        qweight = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)  # [V, E]
        q = qweight.float() * scale  # [V, E]; float32 rounding of Q is within the ROUNDING allowance
        up = 1.0 + 1e-4  # float32 norms of E terms: rounded up to stay upper bounds
        residual = (w - q).norm(dim=1) * up  # [V]
        qnorm = q.norm(dim=1) * up  # [V]
        return cls(w, None if bias is None else bias.detach(), qweight, scale, residual, qnorm, kernel)

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """The head's argmax for each row of ``h``.

        Args:
            h: ``[M, E]`` float32 final hidden states (after the model's last norm).

        Returns:
            ``[M]`` int64 token ids (the lowest id among exactly equal float32 maxima, as ``torch.argmax``).
        """
        h = h.contiguous()
        if h.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=h.device)
        if not bool(torch.isfinite(h).all()):  # no bound holds: the full head decides, as without the screen
            return self._full(h).argmax(-1)
        approx = self.kernel(h, self.qweight, self.scale)  # [M, V]
        if self.bias is not None:
            approx = approx + self.bias
        norm = h.norm(dim=1)  # [M] ||h||
        e_norm = math.sqrt(h.shape[1]) * h.abs().amax(1) / (2 * ACT16_MAX)  # [M] bound on ||h - ĥ||
        a, b = norm * (1 + ROUNDING), e_norm + ROUNDING * norm  # [M]: |exact - approx| <= a * residual + b * qnorm
        top = approx.argmax(1)  # [M]
        rows = torch.arange(h.shape[0], device=h.device)
        lower = approx[rows, top] - a * self.residual[top] - b * self.qnorm[top]  # [M] <= the row's true max
        loose = lower - a * self.residual.max() - b * self.qnorm.max()  # [M] below every candidate's approx
        cand_rows, cand_cols = (approx >= loose[:, None]).nonzero(as_tuple=True)
        slack = a[cand_rows] * self.residual[cand_cols] + b[cand_rows] * self.qnorm[cand_cols]
        upper = approx[cand_rows, cand_cols] + slack
        keep = upper >= lower[cand_rows]
        cand_rows, cand_cols = cand_rows[keep], cand_cols[keep]
        union, slot = torch.unique(cand_cols, return_inverse=True)  # [U] sorted ids, each candidate's column
        exact = h @ self.weight[union].T  # [M, U] float32
        if self.bias is not None:
            exact = exact + self.bias[union]
        scores = torch.full_like(exact, -math.inf)
        scores[cand_rows, slot] = exact[cand_rows, slot]
        return union[scores.argmax(1)]

    def _full(self, h: torch.Tensor) -> torch.Tensor:
        out = h @ self.weight.T  # [M, V]
        return out if self.bias is None else out + self.bias
