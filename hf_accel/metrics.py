"""Generation timing: time to first token and decode throughput, measured through a streamer.

Pure Python (no transformers import): ``generate`` calls ``put`` once with the prompt and then once per
step with the new tokens, so the time of the second ``put`` is the time to first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GenerationTiming", "TimingStreamer"]


@dataclass(frozen=True)
class GenerationTiming:
    """Timing of one ``generate`` call.

    Args:
        ttft_s: seconds from the start of the call to the first generated token.
        decode_s: seconds from the first to the last generated token.
        new_tokens: generated tokens per sequence.
    """

    ttft_s: float
    decode_s: float
    new_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first token (per sequence); ``nan`` with fewer than two tokens."""
        if self.new_tokens < 2 or self.decode_s <= 0:
            return float("nan")
        return (self.new_tokens - 1) / self.decode_s


class TimingStreamer:
    """A streamer (``generate(streamer=...)``) that timestamps every step. Batch size 1 only, like HF's."""

    def __init__(self, inner: Any | None = None) -> None:
        self.inner = inner
        self.start = time.perf_counter()
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

    def timing(self) -> GenerationTiming:
        """The timing of the finished call (the first ``put`` is the prompt and is not counted)."""
        steps = self.stamps[1:]
        if not steps:
            return GenerationTiming(float("nan"), 0.0, 0)
        return GenerationTiming(steps[0] - self.start, steps[-1] - steps[0], len(steps))
