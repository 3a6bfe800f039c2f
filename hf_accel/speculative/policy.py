"""When speculation pays: the chunk width that maximises expected tokens per second, step by step.

A speculative step feeds every active row ``[last, drafts...]`` padded to one width ``w``, so its cost
grows with ``rows * w`` while its gain is what each row accepts. :class:`SpeculationPolicy` weighs both:

* :class:`StepCost` fits ``seconds = fixed + per_token * tokens_fed`` to the steps it has timed (recent
  steps weigh more), so the cost of any width is predicted, not guessed;
* each row keeps its last few ``(accepted, proposed)`` samples; a proposal cut to ``k`` tokens is expected
  to gain ``mean(min(accepted, k))`` (a sample cut short by its own proposal counts as a lower bound);
* each step the width with the most expected tokens per second wins; ``w = 1`` is a plain decoding step.

Free, deterministic proposers (prompt lookup) are *shadowed*: each row's whole proposal, verified in part,
in full or not at all, is compared with the tokens the row then produces, so the policy learns how much of it
would have been accepted even where it cut it short or skipped it, and speculation switches back on as soon
as a row starts copying again. For other proposers only verified drafts are samples: one accepted in full
counts ``optimism`` tokens more (so cut proposals grow back), and a row unobserved for ``forget_after`` steps
forgets its samples and is probed again.

Pure Python; unit-tested on its own (``tests/test_speculative_core.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["SpeculationPolicy", "StepCost"]


class StepCost:
    """Seconds of one target forward as a line in the tokens it feeds, fitted online.

    A weighted least-squares fit with exponential forgetting; the slope is pulled towards a prior (one extra
    token costs ``1 / prior_tokens`` of the fixed part) with the weight of ``prior_weight`` tokens of spread,
    so a fit from plain steps alone (all the same size) still predicts wider steps sensibly.

    Args:
        decay: weight kept by older samples at each new one.
        prior_tokens: prior for ``fixed / per_token``.
        prior_weight: strength of that prior (tokens squared per unit of sample weight).
    """

    def __init__(self, decay: float = 0.97, prior_tokens: float = 16.0, prior_weight: float = 4.0) -> None:
        self.decay, self.prior_tokens, self.prior_weight = decay, prior_tokens, prior_weight
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def record(self, tokens: int, seconds: float) -> None:
        """One timed forward that fed ``tokens`` tokens (rows times width)."""
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + tokens * tokens
        self._nt = d * self._nt + tokens * seconds

    def line(self) -> tuple[float, float]:
        """``(fixed, per_token)`` seconds; ``(0, 0)`` before any sample."""
        if self._w == 0:
            return 0.0, 0.0
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn - self._w * mean_n * mean_n  # weighted spread of the sizes, centred
        cov = self._nt - self._w * mean_n * mean_t
        prior_slope = mean_t / (self.prior_tokens + mean_n)
        lam = self.prior_weight * self._w
        slope = max(0.0, (cov + lam * prior_slope) / (max(var, 0.0) + lam))
        return max(0.0, mean_t - slope * mean_n), slope

    def predict(self, tokens: int) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * tokens


class SpeculationPolicy:
    """Chooses each step's chunk width from the predicted step cost and every row's recent acceptance.

    Args:
        cost: the step-cost model (a strategy instance reused across calls keeps refining one fit per model).
        window: ``(accepted, proposed)`` samples kept per row.
        prior: the samples a row starts from before it has its own (then the pooled samples of all rows of
            the call are used, once there are any).
        forget_after: steps without a new sample after which a row's samples are forgotten (it is probed anew).
        optimism: extra tokens credited to a proposal accepted in full (its true length is unknown).
    """

    def __init__(
        self,
        cost: StepCost,
        window: int = 8,
        prior: Sequence[tuple[int, int]] = ((1, 1),),
        forget_after: int = 16,
        optimism: int = 2,
    ) -> None:
        self.cost, self.window, self.prior, self.forget_after = cost, window, list(prior), forget_after
        self.optimism = optimism
        self.rows: list[deque[tuple[int, int]]] = []
        self.pooled: deque[tuple[int, int]] = deque(maxlen=4 * window)
        self.stale: list[int] = []
        self.shadows: list[tuple[list[int], int] | None] = []
        self.plain_steps = 0

    # -- per call ----------------------------------------------------------------------------------
    def reset(self, batch: int) -> None:
        self.rows = [deque(maxlen=self.window) for _ in range(batch)]
        self.pooled.clear()
        self.stale = [0] * batch
        self.shadows = [None] * batch
        self.plain_steps = 0

    def select(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.stale = [self.stale[i] for i in keep]
        self.shadows = [self.shadows[i] for i in keep]

    # -- decisions ---------------------------------------------------------------------------------
    def expected_gain(self, row: int, k: int) -> float:
        """Expected accepted drafts of ``row`` for a proposal of ``k`` tokens."""
        if k <= 0:
            return 0.0
        samples = self.rows[row] or self.pooled or self.prior
        # a proposal accepted in full says only "at least that many": it counts `optimism` tokens more, so a
        # row whose drafts were cut short is offered longer ones again
        return sum(min(a + (self.optimism if a == p else 0), k) for a, p in samples) / len(samples)

    def choose(self, lengths: Sequence[int], producing: int | None = None) -> int:
        """Drafts per row for this step (the chunk width minus one; 0 = a plain step).

        Args:
            lengths: the drafts each row of the batch has (or may have) this step.
            producing: rows that produce a token this step (default: all; finished rows still in the batch
                cost their share of the forward but produce nothing).
        """
        longest = max(lengths, default=0)
        if longest == 0:
            return 0
        rows = len(lengths)
        base = rows if producing is None else producing
        best_k, best_rate = 0, base / max(self.cost.predict(rows), 1e-12)
        for k in range(1, longest + 1):
            tokens = base + sum(self.expected_gain(i, min(k, n)) for i, n in enumerate(lengths))
            rate = tokens / max(self.cost.predict(rows * (1 + k)), 1e-12)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self.plain_steps += 1
        return best_k

    # -- feedback ----------------------------------------------------------------------------------
    def record_step(self, rows: int, width: int, seconds: float) -> None:
        self.cost.record(rows * width, seconds)

    def observe(self, row: int, accepted: int, proposed: int) -> None:
        """A verified proposal of ``row`` (nothing happens for ``proposed == 0``)."""
        if proposed > 0:
            self._sample(row, accepted, proposed)

    def tick(self) -> None:
        """One step passed: rows without fresh samples age, and forget them after ``forget_after`` steps."""
        for i in range(len(self.stale)):
            self.stale[i] += 1
            if self.stale[i] > self.forget_after:
                self.rows[i].clear()
                self.stale[i] = 0

    def shadow(self, row: int, drafts: Sequence[int]) -> None:
        """An unverified proposal of ``row``; it is scored against the tokens the row produces next."""
        if drafts and self.shadows[row] is None:
            self.shadows[row] = (list(drafts), 0)

    def produced(self, row: int, tokens: Sequence[int]) -> None:
        """Tokens ``row`` appended this step (scores its pending shadow proposal, if any)."""
        pending = self.shadows[row]
        if pending is None:
            return
        drafts, matched = pending
        for tok in tokens:
            if matched == len(drafts) or tok != drafts[matched]:
                self.shadows[row] = None
                self._sample(row, matched, len(drafts))
                return
            matched += 1
        self.shadows[row] = (drafts, matched)

    def _sample(self, row: int, accepted: int, proposed: int) -> None:
        self.rows[row].append((accepted, proposed))
        self.pooled.append((accepted, proposed))
        self.stale[row] = 0
