"""Speculative strategies: what proposes draft tokens, behind one small protocol.

A strategy serves one ``generate`` call at a time. The loop (:mod:`.loop`) calls :meth:`Strategy.start` first,
:meth:`Strategy.prefilled` ``(ragged)`` once the target has run the prompt (a strategy with a cache of its own
may start from the target's), then, per step, for the rows still running (indices are positions in the
*active* batch):

* :meth:`Strategy.propose` ``(sequences, budgets)`` -> one :class:`Proposal` per row, at most ``budget``
  tokens each (the budget is the row's adaptive ``k`` capped by what the row may still generate);
* :meth:`Strategy.observe` ``(proposed, accepted)`` after verification, which also adapts ``k`` per row;
* :meth:`Strategy.select` ``(keep)`` when rows finish and leave the batch.

Adaptive ``k`` (:class:`AdaptiveK`): a row whose proposal was accepted in full proposes 2 more next time
(up to ``max_tokens``); a partly accepted one keeps ``k``; one rejected outright proposes half as many. A row
rejected outright ``pause_after`` times in a row stops speculating for ``pause_steps`` steps (plain decoding,
no verify cost), then probes again: speculation that does not pay switches itself off.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import IncompatibleOptionsError
from .policy import SpeculationPolicy, StepCost

__all__ = ["AdaptiveK", "Composite", "PromptLookup", "Proposal", "Strategy"]


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one row.

    Args:
        tokens: ``[k]`` int64 on CPU (``k`` may be 0: no proposal this step).
        probs: ``[k, V]`` the proposer's sampling probabilities for each token, or ``None`` when the proposer is
            deterministic (the verifier then uses ``q = one_hot(token)``).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> Proposal:
        return cls(torch.zeros(0, dtype=torch.long))


def _check_k(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise IncompatibleOptionsError(f"{name} must be an int >= {minimum}, got {value!r}")


class AdaptiveK:
    """Per-row number of draft tokens.

    Args:
        num_tokens: initial ``k``.
        max_tokens: upper bound for ``k`` (default ``2 * num_tokens``).
        adaptive: ``False`` keeps ``k`` fixed.
        pause_after: full rejections in a row that pause speculation for the row (0 = never pause).
        pause_steps: steps a paused row decodes plainly before probing with ``k = 1``.
    """

    def __init__(
        self,
        num_tokens: int,
        max_tokens: int | None = None,
        adaptive: bool = True,
        pause_after: int = 3,
        pause_steps: int = 8,
    ) -> None:
        _check_k("num_speculative_tokens", num_tokens, 1)
        max_tokens = max_tokens if max_tokens is not None else 2 * num_tokens
        _check_k("max_tokens", max_tokens, num_tokens)
        self.num_tokens, self.max_tokens, self.adaptive = num_tokens, max_tokens, adaptive
        self.pause_after, self.pause_steps = pause_after, pause_steps
        self._k: list[int] = []
        self._misses: list[int] = []
        self._paused: list[int] = []

    def reset(self, batch: int) -> None:
        self._k = [self.num_tokens] * batch
        self._misses = [0] * batch
        self._paused = [0] * batch

    def budgets(self) -> list[int]:
        """``k`` of every active row this step (0 for a paused row)."""
        out = []
        for i, k in enumerate(self._k):
            if self._paused[i] > 0:
                self._paused[i] -= 1
                out.append(0)
            else:
                out.append(k)
        return out

    def observe(self, row: int, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:  # all accepted: try more
            self._k[row] = min(self.max_tokens, self._k[row] + 2)
            self._misses[row] = 0
            return
        if accepted > 0:  # partly accepted: k was about right
            self._misses[row] = 0
            return
        self._k[row] = max(1, self._k[row] // 2)  # nothing accepted: halve
        self._misses[row] += 1
        if self.pause_after and self._misses[row] >= self.pause_after:
            self._paused[row], self._misses[row] = self.pause_steps, 0

    def select(self, keep: Sequence[int]) -> None:
        self._k = [self._k[i] for i in keep]
        self._misses = [self._misses[i] for i in keep]
        self._paused = [self._paused[i] for i in keep]


class Strategy:
    """Base class of speculative strategies (see the module docstring for the protocol).

    Args:
        num_tokens: initial draft tokens per step.
        adaptive: adapt ``k`` per row from acceptance (:class:`AdaptiveK`).
        max_tokens: upper bound of the adaptive ``k``.
        fallback: let the loop choose each step's draft length (none: a plain step) by the expected tokens per
            second (:class:`~hf_accel.speculative.policy.SpeculationPolicy`); ``False`` always drafts.
    """

    #: short name used in stats and logs
    name = "strategy"
    #: proposals are free and deterministic: the policy may score them on plain steps without verifying them
    shadow = False
    #: greedy calls without logits processors or returned scores verify through the int8-screened LM head
    #: (:mod:`~hf_accel.speculative.screen`: the same argmax, exactly; applies where the loop can build one); set
    #: ``False`` on an instance to always run the target's float head
    screen_head = True

    def __init__(
        self, num_tokens: int = 5, adaptive: bool = True, max_tokens: int | None = None, fallback: bool = True
    ) -> None:
        self.k = AdaptiveK(num_tokens, max_tokens, adaptive)
        self.fallback = fallback
        self._costs: weakref.WeakKeyDictionary[torch.nn.Module, StepCost] = weakref.WeakKeyDictionary()

    # -- per call -----------------------------------------------------------------------------------
    def start(
        self, target: torch.nn.Module, batch: int, sampling: bool, processors: Sequence[Callable[..., Any]] = ()
    ) -> None:
        """A new ``generate`` call on ``target`` with ``batch`` rows. Subclasses extend it.

        Args:
            target: the model being sped up.
            batch: rows of the call.
            sampling: whether the call samples (else greedy).
            processors: the call's logits processors (a draft model applies them to its own logits).
        """
        self.k.reset(batch)
        self.sampling = sampling
        self.processors = list(processors)

    def prefilled(self, ragged: Any) -> None:
        """The target has run the prompt: ``ragged`` (a :class:`~.ragged.RaggedCache`) holds its cache and
        layout. A strategy with a cache of its own may start from it rather than run the prompt again; the
        default does nothing."""

    def finish(self) -> None:
        """The call ended (normally or not): drop per-call state."""

    def policy(self, target: torch.nn.Module) -> SpeculationPolicy:
        """A fresh per-call policy; the step-cost fit of ``target`` is kept across the calls that reuse this
        strategy instance (it describes the model on this machine, not the prompt). Strategies made from
        ``generate`` keywords (``prompt_lookup=True``, ``speculative=True``, ``draft_model=``) are kept by the
        patched model, so their fit persists too."""
        cost = self._costs.get(target)
        if cost is None:
            cost = self._costs[target] = StepCost()
        return SpeculationPolicy(cost)

    # -- per step -----------------------------------------------------------------------------------
    def propose(self, sequences: Sequence[torch.Tensor], budgets: Sequence[int]) -> list[Proposal]:
        """Draft tokens for every active row.

        Args:
            sequences: each row's real tokens so far (prompt without padding, then generated), ``[L_i]`` int64 CPU.
            budgets: the most tokens each row may propose.
        """
        raise NotImplementedError

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        """Verification result of every active row (in the order of the last :meth:`propose`)."""
        for row, (p, a) in enumerate(zip(proposed, accepted, strict=True)):
            self.k.observe(row, p, a)

    def select(self, keep: Sequence[int]) -> None:
        """Only the active rows ``keep`` (indices into the active batch) go on."""
        self.k.select(keep)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_tokens={self.k.num_tokens}, adaptive={self.k.adaptive})"


class PromptLookup(Strategy):
    """Drafts by copying: the tokens that followed an earlier occurrence of the sequence's last n-gram.

    Pure tensor code. For ``n`` from ``max_ngram`` down to ``min_ngram``, the most recent earlier occurrence of
    the last ``n`` tokens (in the prompt or the generated text) wins; its continuation is the proposal. A
    continuation that reaches the end of the sequence goes on as the repetition it is (``a b c a b`` proposes
    ``c a b c ...``). No match: no proposal (a plain decoding step, nothing wasted), except just after an edit:
    when the text before the last token was being copied (its n-gram occurs earlier) and the model then wrote
    a token of its own, the copy resumes after that token's first occurrence within ``realign`` tokens of
    where the copy stood (the model skipped or rewrote a few tokens of what it copies).

    The defaults were chosen by measurement on SmolLM2 (``docs/speculative.md``): single-token matches are
    mostly wrong and each rejected proposal costs a wider forward, so ``min_ngram=2``; the most recent
    occurrence is accepted more often than the first (it follows what is being copied right now); proposals cost
    nothing to make and the loop's policy already cuts them to the length that pays, so ``k`` stays fixed
    (``adaptive=False``).

    Args:
        num_tokens: draft tokens per step (default 10).
        max_ngram: longest n-gram matched.
        min_ngram: shortest n-gram matched.
        realign: how far after the copy position the token that broke a copy is looked for (0: never).
            Simulated over recorded greedy outputs of the grounded benchmark task, 4 raised the tokens per
            target forward from 3.12 / 4.57 / 2.72 / 4.00 to 3.20 / 4.74 / 2.72 / 4.13 and left chat unchanged.
        adaptive / max_tokens / fallback: see :class:`Strategy`.
    """

    name = "prompt_lookup"
    shadow = True

    def __init__(
        self,
        num_tokens: int = 10,
        max_ngram: int = 3,
        min_ngram: int = 2,
        realign: int = 4,
        adaptive: bool = False,
        max_tokens: int | None = None,
        fallback: bool = True,
    ) -> None:
        super().__init__(num_tokens, adaptive, max_tokens, fallback)
        _check_k("max_ngram", max_ngram, 1)
        _check_k("min_ngram", min_ngram, 1)
        if min_ngram > max_ngram:
            raise IncompatibleOptionsError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        _check_k("realign", realign, 0)
        self.max_ngram, self.min_ngram, self.realign = max_ngram, min_ngram, realign

    def propose(self, sequences: Sequence[torch.Tensor], budgets: Sequence[int]) -> list[Proposal]:
        return [self.lookup(seq, k) for seq, k in zip(sequences, budgets, strict=True)]

    def _match(self, seq: torch.Tensor) -> int | None:
        """Where the continuation of the most recent earlier occurrence of ``seq``'s last n-gram starts."""
        for n in range(min(self.max_ngram, seq.shape[0] - 1), self.min_ngram - 1, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # [L - n, n]: every earlier n-gram (not the tail itself)
            hits = (windows == seq[-n:]).all(1).nonzero().flatten()
            if hits.numel():
                return int(hits[-1]) + n
        return None

    def _realigned(self, seq: torch.Tensor) -> int | None:
        """After an edit: the copy position of ``seq[:-1]``, moved past the first occurrence of the last token
        within ``realign`` tokens of it; ``None`` when there is none."""
        copied = self._match(seq[:-1]) if self.realign else None
        if copied is None:
            return None
        window = seq[copied : min(copied + self.realign, seq.shape[0] - 2)]  # [<= realign]
        hits = (window == seq[-1]).nonzero().flatten()
        return copied + int(hits[0]) + 1 if hits.numel() else None

    def lookup(self, seq: torch.Tensor, k: int) -> Proposal:
        """Up to ``k`` tokens continuing ``seq`` (``[L]`` int64 CPU) by copying; empty where nothing matches."""
        length = seq.shape[0]
        if k <= 0:
            return Proposal.empty()
        start = self._match(seq)
        if start is None:
            start = self._realigned(seq)
        if start is None:
            return Proposal.empty()
        period = length - start  # past the end, the copy repeats itself (a loop of `period` tokens)
        index = start + torch.arange(k) % period  # [k]
        return Proposal(seq[index])

    def __repr__(self) -> str:
        return (
            f"PromptLookup(num_tokens={self.k.num_tokens}, max_ngram={self.max_ngram}, "
            f"min_ngram={self.min_ngram}, realign={self.realign}, adaptive={self.k.adaptive})"
        )


class Composite(Strategy):
    """Several strategies in order of preference: per row, the first non-empty proposal is used.

    Typical use: ``Composite(PromptLookup(), SelfSpeculative("int8"))`` copies from the prompt where it can
    and drafts with the cheap copy elsewhere. A later strategy is only asked for the rows the earlier ones
    left empty; each strategy learns only from the proposals of its own that were verified.

    Args:
        *strategies: two or more strategies.
        fallback: see :class:`Strategy`.
    """

    name = "composite"

    def __init__(self, *strategies: Strategy, fallback: bool = True) -> None:
        if len(strategies) < 2 or not all(isinstance(s, Strategy) for s in strategies):
            raise IncompatibleOptionsError("Composite takes two or more Strategy instances")
        super().__init__(max(s.k.max_tokens for s in strategies), adaptive=False, fallback=fallback)
        self.strategies = list(strategies)
        self.name = "+".join(s.name for s in strategies)
        self.shadow = all(s.shadow for s in strategies)
        self._used: list[int | None] = []

    def start(self, target, batch, sampling, processors=()) -> None:  # type: ignore[no-untyped-def]
        super().start(target, batch, sampling, processors)
        for s in self.strategies:
            s.start(target, batch, sampling, processors)

    def prefilled(self, ragged: Any) -> None:
        for s in self.strategies:
            s.prefilled(ragged)

    def finish(self) -> None:
        for s in self.strategies:
            s.finish()

    def propose(self, sequences: Sequence[torch.Tensor], budgets: Sequence[int]) -> list[Proposal]:
        chosen: list[Proposal | None] = [None] * len(sequences)
        self._used = [None] * len(sequences)
        for index, strategy in enumerate(self.strategies):
            own = strategy.k.budgets()
            sub = [min(b, o) if chosen[i] is None else 0 for i, (b, o) in enumerate(zip(budgets, own, strict=True))]
            proposals = strategy.propose(sequences, sub)  # all-zero budgets: empty proposals, nothing fed
            for i, p in enumerate(proposals):
                if chosen[i] is None and p.tokens.shape[0] > 0:
                    chosen[i], self._used[i] = p, index
        return [p if p is not None else Proposal.empty() for p in chosen]

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        for index, strategy in enumerate(self.strategies):
            mine = [u == index for u in self._used]
            strategy.observe(
                [p if m else 0 for p, m in zip(proposed, mine, strict=True)],
                [a if m else 0 for a, m in zip(accepted, mine, strict=True)],
            )

    def select(self, keep: Sequence[int]) -> None:
        super().select(keep)
        for s in self.strategies:
            s.select(keep)

    def __repr__(self) -> str:
        return f"Composite({', '.join(map(repr, self.strategies))})"
