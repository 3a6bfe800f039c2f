"""The ``return_dict_in_generate=True`` output of a speculative call: Transformers' own, plus the stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = ["SpeculativeGenerateOutput"]


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` with ``speculative``: the call's counters (proposed, accepted,
    acceptance_rate, target_forwards, tokens, tokens_per_forward, draft_s, verify_s, strategy)."""

    speculative: dict[str, Any] | None = None
