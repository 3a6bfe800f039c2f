"""Generation measurements: time to first token, time per output token, throughput, memory.

Pure Python (no transformers import). Two probes, both plain objects ``generate`` already knows how to call:
:class:`TimingStreamer` (a streamer: ``put`` once with the prompt, then once per step) and :class:`StepClock`
(a stopping criterion that never stops; patched models attach one to every call and keep the resulting
:class:`GenerationStats`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GenerationStats", "GenerationTiming", "StepClock", "TimingStreamer"]


@dataclass(frozen=True)
class GenerationTiming:
    """Timing of one ``generate`` call.

    Args:
        ttft_s: seconds from the start of the call to the first generated token.
        decode_s: seconds from the first to the last generated token.
        new_tokens: generated tokens per sequence.
        first_tokens: tokens that arrived with the first one (speculative decoding emits several per step).
    """

    ttft_s: float
    decode_s: float
    new_tokens: int
    first_tokens: int = 1

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first arrival (per sequence); ``nan`` when nothing came after it."""
        if self.new_tokens <= self.first_tokens or self.decode_s <= 0:
            return float("nan")
        return (self.new_tokens - self.first_tokens) / self.decode_s


class TimingStreamer:
    """A streamer (``generate(streamer=...)``) that timestamps every step. Batch size 1 only, like HF's."""

    def __init__(self, inner: Any | None = None) -> None:
        self.inner = inner
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.counts: list[int] = []  # tokens per put

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())
        self.counts.append(int(value.numel()) if hasattr(value, "numel") else 1)  # a speculative step: several
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

    def timing(self) -> GenerationTiming:
        """The timing of the finished call (the first ``put`` is the prompt and is not counted)."""
        steps, counts = self.stamps[1:], self.counts[1:]
        if not steps:
            return GenerationTiming(float("nan"), 0.0, 0)
        return GenerationTiming(steps[0] - self.start, steps[-1] - steps[0], sum(counts), counts[0])


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _resident_peak_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@dataclass(frozen=True)
class GenerationStats:
    """Measurements of one ``generate`` call on a patched model (``hf_accel.last_stats(model)``, or
    ``output.metrics`` with ``return_dict_in_generate=True``).

    Args:
        batch: rows in the call (after ``num_return_sequences`` expansion).
        prompt_tokens: real (non-padding) prompt tokens, all rows.
        new_tokens: generated tokens, all rows (padding after EOS not counted).
        total_s: wall time of the call.
        ttft_s: time from the call to the first generated token.
        tpot_mean_s / tpot_p50_s / tpot_p90_s: time per output token after the first (per decoding step).
        kv_bytes_reserved / kv_bytes_used: KV-cache bytes held, and bytes holding live tokens (``None`` when
            the cache is not known).
        peak_memory_bytes: the process's peak so far: CUDA ``max_memory_allocated`` on GPU (never reset by hf_accel:
            call ``torch.cuda.reset_peak_memory_stats()`` before a call to see that call's), peak resident set on CPU.
        speculative: the speculative counters of the call, if it was speculative.
        speculation_skipped: why a patch that speculates greedy calls automatically (``SpeculativeConfig.auto``,
            the CPU default) decoded this call as usual (``None``: it speculated, or no automatic speculation is on).
    """

    batch: int
    prompt_tokens: int
    new_tokens: int
    total_s: float
    ttft_s: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    kv_bytes_reserved: int | None = None
    kv_bytes_used: int | None = None
    peak_memory_bytes: int | None = None
    speculative: dict[str, Any] | None = None
    speculation_skipped: str | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second after the first token, all rows together."""
        decode = self.total_s - self.ttft_s
        after_first = self.new_tokens - self.batch
        return after_first / decode if decode > 0 and after_first > 0 else float("nan")

    @property
    def end_to_end_tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.update(
            decode_tokens_per_s=self.decode_tokens_per_s,
            end_to_end_tokens_per_s=self.end_to_end_tokens_per_s,
            prompt_tokens_per_s=self.prompt_tokens_per_s,
        )
        return out


class StepClock:
    """A stopping criterion that never stops: it timestamps every call (once per decoding step in plain
    ``generate``, once per emitted token in speculative decoding). Costs one ``perf_counter`` per call."""

    #: never reads ``scores`` (speculative greedy calls may then verify through the screened LM head)
    reads_scores = False

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.rows = 0

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.stamps.append(time.perf_counter())
        self.rows = max(self.rows, int(input_ids.shape[0]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def intervals(self) -> list[float]:
        """Gaps between distinct steps (several stamps of one speculative step count once)."""
        steps = [self.stamps[0]] if self.stamps else []
        for t in self.stamps[1:]:
            if t - steps[-1] > 1e-4:
                steps.append(t)
        return [b - a for a, b in itertools.pairwise(steps)]

    def stats(
        self,
        batch: int,
        prompt_tokens: int,
        new_tokens: int,
        end: float,
        kv: tuple[int | None, int | None] = (None, None),
        peak_memory: int | None = None,
        speculative: dict[str, Any] | None = None,
        speculation_skipped: str | None = None,
    ) -> GenerationStats:
        gaps = self.intervals()
        ttft = (self.stamps[0] - self.start) if self.stamps else end - self.start
        return GenerationStats(
            batch=batch,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            total_s=end - self.start,
            ttft_s=ttft,
            tpot_mean_s=sum(gaps) / len(gaps) if gaps else float("nan"),
            tpot_p50_s=_percentile(gaps, 0.5),
            tpot_p90_s=_percentile(gaps, 0.9),
            kv_bytes_reserved=kv[0],
            kv_bytes_used=kv[1],
            peak_memory_bytes=peak_memory if peak_memory is not None else _resident_peak_bytes(),
            speculative=speculative,
            speculation_skipped=speculation_skipped,
        )
