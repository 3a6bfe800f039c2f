"""The result of a speculative call: its counters (:class:`SpeculativeStats`) and, with
``return_dict_in_generate=True``, Transformers' own output class plus those counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .rows import Rows

__all__ = ["SpeculativeGenerateOutput", "SpeculativeStats", "build_output"]


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` with ``speculative``: the call's counters (proposed, accepted,
    acceptance_rate, target_forwards, tokens, tokens_per_forward, draft_s, verify_s, strategy)."""

    speculative: dict[str, Any] | None = None


@dataclass
class SpeculativeStats:
    """Counters of one speculative ``generate`` call.

    Args:
        strategy: the strategy's name.
        proposed / accepted: draft tokens proposed and accepted, all rows together.
        target_forwards: forward passes of the target, prefill included.
        tokens: tokens generated, all rows together.
        row_forwards: rows taking part in each target forward, summed (a finished row stops counting).
        plain_steps: steps the :class:`~.policy.SpeculationPolicy` ran without drafts although some row had
            (or could have had) a proposal, because the drafts were not expected to pay for the wider forward.
        draft_s / verify_s: seconds spent proposing, and in target forwards plus verification.
        head: how greedy verification scored: ``"int8 screen"``, or ``"float head: <why not the screen>"``.
        target: what ran the target's chunks over Transformers' cache: ``"native executor (cpu/<isa>)"``, or
            ``"model forward: <why>"`` (over the paged cache: its own fast paths, ``"paged cache"``).
        cache: what the call left in a Transformers cache someone keeps (the caller's, or the one
            ``return_dict_in_generate`` returns): ``"kept"`` (K/V of the sequences but their last token, as
            Transformers' decoding leaves it), ``"emptied: <why>"`` (passed back, the next call recomputes it), or
            ``""`` (none kept).
    """

    strategy: str
    proposed: int = 0
    accepted: int = 0
    target_forwards: int = 0
    tokens: int = 0
    row_forwards: int = 0
    plain_steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    head: str = ""
    target: str = ""
    cache: str = ""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens a row gained per target forward (1.0 = no gain over plain decoding)."""
        return self.tokens / self.row_forwards if self.row_forwards else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, tokens_per_forward=self.tokens_per_forward)
        return out


def _stacked(history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], which: int, longest: int):
    """Per step, every row's scores (``which`` 0) or logits (1) stacked ``[B, V]``; zeros for a row that had
    stopped."""
    steps = []
    for t in range(longest):
        ref = next(h[t][which] for h in history.values() if len(h) > t)
        steps.append(torch.stack([h[t][which] if len(h) > t else torch.zeros_like(ref) for h in history.values()]))
    return tuple(steps)


def build_output(
    rows: Rows, config: Any, history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], stats: SpeculativeStats,
    cache: Any, want: tuple[bool, bool],
) -> Any:  # fmt: skip
    """What ``generate`` returns: ``[B, P + longest]`` sequences (padded with the pad token after a row stopped), or
    with ``return_dict_in_generate`` a :class:`SpeculativeGenerateOutput` (scores / logits where ``want`` says)."""
    longest = max(len(g) for g in rows.generated)
    pad = config._pad_token_tensor
    tail = torch.full((len(rows.generated), longest), int(pad) if pad is not None else 0, dtype=torch.long)
    for i, g in enumerate(rows.generated):
        tail[i, : len(g)] = torch.tensor(g, dtype=torch.long)
    sequences = torch.cat([rows.prompt, tail.to(rows.prompt.device)], 1)
    if not config.return_dict_in_generate:
        return sequences
    return SpeculativeGenerateOutput(
        sequences=sequences,
        scores=_stacked(history, 0, longest) if want[0] else None,
        logits=_stacked(history, 1, longest) if want[1] else None,
        cache=cache,
        speculative=stats.as_dict(),
    )
