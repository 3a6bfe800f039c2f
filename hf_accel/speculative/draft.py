"""Model-based drafting: a smaller model (:class:`DraftModel`) or a cheaper copy of the target
(:class:`SelfSpeculative`).

The draft keeps its own cache over the same ragged rows as the target (:class:`.ragged.RaggedCache`): each
step it first feeds what it has not seen of every row (the target's last token, and a fully accepted
proposal's final draft), then proposes autoregressively; after verification it rolls back each row to the
accepted prefix. In sampling mode it samples from its own processed distribution and hands those
probabilities to the verifier (rejection sampling needs them). Its steps and catch-ups run through a
:class:`hf_accel.native.step.LeanStep` where the draft's architecture allows (Llama family), else through its own
forward, over a cache that appends in place (:mod:`hf_accel.native.growing`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleOptionsError
from ..core.gate import model_gate
from ..native.growing import rollback_cache
from ..native.step import LeanStep
from .ragged import LEAN_MAX_WIDTH, RaggedCache
from .rows import row_independent
from .strategies import PromptLookup, Proposal, Strategy

__all__ = ["DraftModel"]

logger = logging.getLogger("hf_accel.speculative")

#: Longest prompt-lookup guess a row checks at first; it doubles while guesses hold and shrinks to what held
_FIRST_GUESS = 4
#: Guesses are checked while the draft runs at most this many rows. Every row of a batch drafts in the same
#: forwards, so a batch's guess check is as wide as its longest guess and a round lasts until its slowest row has its
#: budget: measured on SmolLM2's grounded benchmark prompts (int8 self-speculation), guesses cut the draft's time by
#: 30% at batch 1 and added 7% at batch 4 (docs/speculative.md)
_GUESS_MAX_ROWS = 1


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _vocab(model: nn.Module) -> int:
    out = model.get_output_embeddings()
    return int(out.weight.shape[0]) if out is not None and hasattr(out, "weight") else int(model.config.vocab_size)


class _Drafts:
    """The tokens (and sampling probabilities) every row drafts in one ``propose``, and how many of them the
    draft's cache holds."""

    def __init__(self, sequences: Sequence[torch.Tensor], budgets: Sequence[int]) -> None:
        self.sequences, self.budgets = sequences, list(budgets)
        self.tokens: list[list[int]] = [[] for _ in sequences]
        self.probs: list[list[torch.Tensor]] = [[] for _ in sequences]
        self.fed = [0] * len(sequences)  # drafted tokens of each row in the draft's cache

    def count(self, row: int) -> int:
        return len(self.tokens[row])

    def room(self, row: int) -> int:
        return self.budgets[row] - len(self.tokens[row])

    def full(self, row: int) -> bool:
        return len(self.tokens[row]) >= self.budgets[row]

    def add(self, row: int, token: int, probs: torch.Tensor | None) -> None:
        self.tokens[row].append(token)
        if probs is not None:
            self.probs[row].append(probs)

    def tail(self, row: int) -> torch.Tensor:
        """``[1]``: the row's last drafted token (not in the cache yet)."""
        return torch.tensor(self.tokens[row][-1:], dtype=torch.long)

    def context(self, row: int) -> torch.Tensor:
        """``[L + n]`` the row's real tokens followed by its drafts so far (CPU)."""
        return torch.cat([self.sequences[row], torch.tensor(self.tokens[row], dtype=torch.long)])

    def proposals(self) -> list[Proposal]:
        return [
            Proposal(torch.tensor(tokens, dtype=torch.long), torch.stack(probs) if probs else None)
            for tokens, probs in zip(self.tokens, self.probs, strict=True)
        ]


class DraftModel(Strategy):
    """Drafts with a smaller causal LM that shares the target's tokenizer.

    Args:
        draft: the draft model (same vocabulary, same device as the target).
        num_tokens: initial draft tokens per step.
        adaptive / max_tokens / fallback: see :class:`~.strategies.Strategy`. ``fallback`` is off by default
            for model drafts: after a pause the draft must catch up on every token it missed, which makes the
            first step after a pause look slow and re-triggers the pause (measured: int8 self-speculation on
            chat prompts fell from 1.3-1.8x to 0.86x with it on); their per-row adaptive ``k`` pauses instead.
        lookup: check prompt-lookup guesses with the draft while it drafts for a single row: each draft forward also
            feeds the tokens that copying from the text predicts next, and the draft's own tokens follow them for as
            long as they agree, so one forward drafts several tokens where the text is being copied. The proposals
            are the ones token-by-token drafting makes (the draft's numerics aside); only the number of draft
            forwards changes. (Rows of a batch share every draft forward, and there the checks cost more than they
            saved: see ``docs/speculative.md``.)

    Raises:
        IncompatibleOptionsError: (at the call) a different vocabulary size or another device.
    """

    name = "draft"

    def __init__(
        self,
        draft: nn.Module,
        num_tokens: int = 5,
        adaptive: bool = True,
        max_tokens: int | None = None,
        fallback: bool = False,
        lookup: bool = True,
    ) -> None:
        super().__init__(num_tokens, adaptive, max_tokens, fallback)
        if not isinstance(draft, nn.Module) or not hasattr(draft, "config"):
            raise IncompatibleOptionsError(f"draft_model must be a Transformers causal LM, got {type(draft).__name__}")
        self.draft = draft
        self._lookups(lookup)

    def _lookups(self, lookup: bool) -> None:
        if not isinstance(lookup, bool):
            raise IncompatibleOptionsError(f"{type(self).__name__}.lookup must be True or False, got {lookup!r}")
        self.lookup = lookup
        self._guesser = PromptLookup(num_tokens=1)

    def _check(self, target: nn.Module) -> None:
        dv, tv = _vocab(self.draft), _vocab(target)
        if dv != tv:
            raise IncompatibleOptionsError(
                f"the draft model's vocabulary has {dv} tokens but the target's has {tv}: a draft must share the "
                "target's tokenizer"
            )
        dd, td = _device(self.draft), _device(target)
        if dd != td:
            raise IncompatibleOptionsError(
                f"the draft model is on {dd} but the target is on {td}; move the draft to {td} "
                "(drafts across devices are not supported)"
            )

    def start(self, target: nn.Module, batch: int, sampling: bool, processors: Sequence[Callable[..., Any]] = ()):
        self._check(target)
        super().start(target, batch, sampling, processors)
        model = self._draft_for(target)
        # the draft's calls wait while the target compiles (core/gate.py); a target drafting for itself is gated
        # by its own forward already (the gate is not re-entrant)
        self._gate = model_gate(target) if model is not target else None
        self._step = LeanStep.build(model)
        self._ragged = RaggedCache(
            model,
            rollback_cache(model.config),
            torch.zeros(batch, 0, dtype=torch.long, device=_device(model)),
            self._step,
        )
        self._seen = [0] * batch  # real tokens of each row the draft cache holds
        self._fed = [0] * batch  # each row's draft tokens fed back in the last propose (observe rolls back)
        self._guess_len = [_FIRST_GUESS] * batch  # longest prompt-lookup guess each row checks next

    def _draft_for(self, target: nn.Module) -> nn.Module:
        return self.draft

    def finish(self) -> None:
        self._ragged = None
        self._gate = None

    def _pick(self, row_ids: list[torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next draft token of every row from ``logits`` ``[B, V]``, and the sampling probabilities."""
        scores = logits.float()
        if self.processors:
            scores = torch.cat([self._process(ids[None], s[None]) for ids, s in zip(row_ids, scores, strict=True)])
        if not self.sampling:
            return scores.argmax(-1), None
        probs = scores.softmax(-1)
        return torch.multinomial(probs, 1).squeeze(-1), probs

    def _process(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # the draft's own distribution q only has to be the one it samples from: batch-indexed processors
        # (which would need the target's batch layout) are left out
        for proc in self.processors:
            if row_independent(proc):
                scores = proc(ids, scores)
        return scores

    def propose(self, sequences: Sequence[torch.Tensor], budgets: Sequence[int]) -> list[Proposal]:
        rows = len(sequences)
        self._fed = [0] * rows
        if max(budgets) == 0:
            return [Proposal.empty() for _ in sequences]
        drafts = _Drafts(sequences, budgets)
        # the first feed catches up on every row's tokens the draft has not seen
        pending = [seq[n:] for seq, n in zip(sequences, self._seen, strict=True)]
        self._seen = [seq.shape[0] for seq in sequences]
        with torch.no_grad():
            while pending is not None:
                pending = self._draft_round(drafts, pending)
        self._fed = drafts.fed
        self._seen = [n + f for n, f in zip(self._seen, drafts.fed, strict=True)]
        return drafts.proposals()

    def _draft_round(self, drafts: _Drafts, pending: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """One draft forward: each row's ``pending`` tokens (not in the cache yet) plus, with ``lookup``, a
        prompt-lookup guess of what the draft will say next; the draft's tokens follow the guess as long as they
        agree with it. Returns the next round's pending tokens, or ``None`` when every row has its budget."""
        ragged = self._ragged
        device = _device(ragged.model)
        guesses = [self._guess(drafts, i, p.shape[0]) for i, p in enumerate(pending)]  # [m_i] each
        feeds = [torch.cat([p, g]) for p, g in zip(pending, guesses, strict=True)]
        width = max(f.shape[0] for f in feeds)
        chunk = torch.zeros(len(feeds), width, dtype=torch.long)  # [B, W] right-aligned, holes on the left
        valid = torch.zeros(len(feeds), width, dtype=torch.bool)
        for i, f in enumerate(feeds):
            chunk[i, width - f.shape[0] :] = f
            valid[i, width - f.shape[0] :] = True
        last = 1 + max(g.shape[0] for g in guesses)
        with self._gate.shared() if self._gate is not None else contextlib.nullcontext():
            logits = ragged.feed(chunk.to(device), valid.to(device), last=last)  # [B, last, V]
        picks = None if self.sampling or self.processors else logits.argmax(-1).cpu()  # [B, last] greedy, plain
        drop = [0] * len(feeds)
        for i, guess in enumerate(guesses):
            if drafts.full(i):
                continue
            if pending[i].shape[0] and drafts.count(i):  # the last round's final draft token, now in the cache
                drafts.fed[i] += 1
            matched = 0
            for j in range(guess.shape[0] + 1):
                column = last - guess.shape[0] - 1 + j
                if picks is not None:
                    token, probs = int(picks[i, column]), None
                else:
                    context = drafts.context(i).to(device)
                    pick, dist = self._pick([context], logits[i, column][None])
                    token, probs = int(pick[0]), None if dist is None else dist[0]
                drafts.add(i, token, probs)
                if j == guess.shape[0] or token != int(guess[j]) or drafts.full(i):
                    break
                matched += 1  # the guess was the draft's own next token: its K/V are already in the cache
            drafts.fed[i] += matched
            drop[i] = guess.shape[0] - matched
            if guess.shape[0]:  # a row whose guesses hold guesses further; a miss shrinks them to what held
                held = matched == guess.shape[0]
                self._guess_len[i] = min(2 * self._guess_len[i], LEAN_MAX_WIDTH) if held else max(1, matched)
        ragged.rollback(drop)
        if all(drafts.full(i) for i in range(len(feeds))):
            return None
        empty = torch.zeros(0, dtype=torch.long)
        return [empty if drafts.full(i) else drafts.tail(i) for i in range(len(feeds))]

    def _guess(self, drafts: _Drafts, row: int, pending: int) -> torch.Tensor:
        """The prompt-lookup guess of the tokens after the row's text so far (no more than the row can still
        draft after the next token, nor than a lean draft step takes); empty without ``lookup``."""
        room = min(drafts.room(row) - 1, LEAN_MAX_WIDTH - pending, self._guess_len[row])
        if not self.lookup or room <= 0 or drafts.full(row) or len(drafts.sequences) > _GUESS_MAX_ROWS:
            return torch.zeros(0, dtype=torch.long)
        return self._guesser.lookup(drafts.context(row), room).tokens

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        if any(self._fed):
            keep = [min(a, f) for a, f in zip(accepted, self._fed, strict=True)]
            drop = [f - kept for f, kept in zip(self._fed, keep, strict=True)]
            self._ragged.rollback(drop)
            self._seen = [n - d for n, d in zip(self._seen, drop, strict=True)]
        self._fed = [0] * len(self._fed)
        super().observe(proposed, accepted)

    def select(self, keep: Sequence[int]) -> None:
        super().select(keep)
        if keep:
            self._ragged.select(keep)
        self._seen = [self._seen[i] for i in keep]
        self._fed = [self._fed[i] for i in keep]
        self._guess_len = [self._guess_len[i] for i in keep]

    def __repr__(self) -> str:
        return (
            f"DraftModel({type(self.draft).__name__}, num_tokens={self.k.num_tokens}, adaptive={self.k.adaptive}"
            f"{'' if self.lookup else ', lookup=False'})"
        )
