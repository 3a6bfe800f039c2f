"""The speculative decoding loop, run by ``generate(custom_generate=...)`` (see :mod:`.apply`).

Transformers prepares everything a decoding method needs (generation config, logits processors with the
sampling warpers, stopping criteria with max length / EOS / stop strings, the cache, the expanded inputs);
this loop replaces only the token-by-token part:

1. prefill the prompt; pick each row's first token like plain decoding;
2. per step, the strategy proposes up to ``k_i`` tokens per row; the target scores every row's
   ``[last, drafts...]`` in one forward (rows ragged: see :class:`.ragged.RaggedCache`);
3. per row, verification keeps a prefix of the drafts plus one target token (:mod:`.verify`); tokens are
   appended one at a time through the stopping criteria, exactly as plain decoding would stop;
4. each row's rejected drafts are rolled back; finished rows leave the batch.

Logits processors see each row's own sequence at each position (per-row calls), so repetition penalties,
min-length rules and the sampling warpers apply exactly as in plain ``generate``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.call import eos_token_ids
from ..core.errors import IncompatibleOptionsError
from ..core.protocols import RowRollback
from ..native.growing import to_growing
from .kept import claimed
from .output import SpeculativeStats, build_output
from .policy import SpeculationPolicy
from .ragged import RaggedCache
from .rows import (
    Rows,
    check_cache,
    finished_rows_go_on,
    per_row_criteria,
    rope_refusal,
    row_independent,
    scoreless,
    widen,
)
from .screen import HeadScreen
from .strategies import Proposal, Strategy
from .target import head_screen, screen_obstacle, target_obstacle, target_step
from .verify import Verdict, verify_greedy, verify_sampling

__all__ = ["make_custom_generate"]

logger = logging.getLogger("hf_accel.speculative")

#: the (scores, logits) the stopping criteria see for a token picked through the screened head: none were computed,
#: and the screen only runs with criteria that do not read them
_NO_SCORES = (torch.empty(0), torch.empty(0))


class _Loop:
    def __init__(
        self,
        model: nn.Module,
        strategy: Strategy,
        processors: Sequence[Callable[..., torch.Tensor]],
        stopping: Callable[..., torch.Tensor],
        config: Any,
        streamer: Any,
    ) -> None:
        from ..paged.runner import PagedRowTracker

        self.model, self.strategy, self.config, self.streamer = model, strategy, config, streamer
        self.processors = [p for p in processors if not isinstance(p, PagedRowTracker)]
        self.stopping = stopping
        self.sampling = bool(config.do_sample)
        self.stats = SpeculativeStats(strategy.name)
        self.publish = False  # someone keeps the Transformers cache after the call (set by run)
        self.policy: SpeculationPolicy | None = None
        self.want_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.want_logits = bool(config.return_dict_in_generate and config.output_logits)
        #: greedy argmax through the int8-screened head where nothing needs the scores (:mod:`.screen`)
        self.screen: HeadScreen | None = None
        why = self._screen_obstacle(model)
        if why is None:
            self.screen = head_screen(model)
        self.stats.head = "int8 screen" if self.screen is not None else f"float head: {why}"

    def _screen_obstacle(self, model: nn.Module) -> str | None:
        """Why this call's greedy verification cannot use the screened head (``None``: it can)."""
        if not self.strategy.screen_head:
            return "the strategy's screen_head is off"
        if self.sampling or self.processors or self.want_scores or self.want_logits:
            return "the call samples, has logits processors, or returns scores / logits"
        if not all(scoreless(c) for c in self.stopping):
            return "a stopping criterion reads the scores"
        return screen_obstacle(model)

    # ----------------------------------------------------------------------------------- scoring
    def _process(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """All rows of the batch at once (``ids`` ``[B, L]``, every row at the same step), as plain decoding."""
        scores = logits.float()
        for proc in self.processors:
            scores = proc(ids, scores)
        return scores

    def _process_row(self, row: int, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """One row (``ids`` ``[1, L]``, ``logits`` ``[1, V]``) at its own length, with its own batch index."""
        scores = logits.float()
        batch = self.rows.prompt.shape[0]
        for proc in self.processors:
            if row_independent(proc):
                scores = proc(ids, scores)
            else:
                scores = proc(ids.expand(batch, -1), scores.expand(batch, -1).clone())[row : row + 1]
        return scores

    def _pick(self, scores: torch.Tensor) -> torch.Tensor:
        if self.sampling:
            return torch.multinomial(scores.softmax(-1), 1).squeeze(-1)
        return scores.argmax(-1)

    # ------------------------------------------------------------------------------------ running
    def run(self, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> Any:
        cfg = self.config
        mask = model_kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(input_ids)
        from transformers import DynamicCache

        cache = model_kwargs.get("cache")
        # someone keeps a Transformers cache after the call: every row stays in it to the end (RaggedCache.settle)
        publish = cache is not None or bool(cfg.return_dict_in_generate)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        check_cache(self.model, cache, cfg.max_length)
        why = rope_refusal(self.model.config, input_ids.shape[1], cfg.max_length)
        if why is not None:
            raise IncompatibleOptionsError(f"speculative generation would not give the model's own tokens: {why}")
        step = None
        if type(cache) is DynamicCache:  # its full-attention layers append in place from here on (same contract)
            to_growing(cache)
            step = target_step(self.model)
            if step is not None and not step.native.serves(cache):
                step = None  # e.g. sliding-window layers: the model's own forward runs every chunk
            why = target_obstacle(self.model) if step is None else None
            self.stats.target = f"native executor ({step.native.choice.impl})" if step else f"model forward: {why}"
        else:
            self.stats.target = (
                "paged cache" if isinstance(cache, RowRollback) else f"model forward: {type(cache).__name__}"
            )
        self.publish = publish and not isinstance(cache, RowRollback)
        rows = Rows(input_ids, mask, cfg.max_length)
        self.rows = rows
        self.history: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(len(rows.done))}
        ragged = RaggedCache(self.model, cache, mask, step)
        self.strategy.start(self.model, input_ids.shape[0], self.sampling, self.processors)
        if self.strategy.fallback:
            self.policy = self.strategy.policy(self.model)
            self.policy.reset(input_ids.shape[0])
        try:
            self._prefill(ragged, input_ids)
            self.strategy.prefilled(ragged)
            active = self._compact(ragged, list(range(len(rows.done))))
            while active:
                active = self._step(ragged, active)
            if self.publish:
                self.stats.cache = ragged.settle(mask, [len(g) for g in rows.generated])
        finally:
            self.strategy.finish()
            if self.policy is not None:
                self.stats.plain_steps = self.policy.plain_steps
            if isinstance(cache, RowRollback):
                cache.reset()  # rows were re-indexed as they finished: nothing of them is published
        if self.streamer is not None:
            self.streamer.end()
        logger.debug("speculative generate: %s", self.stats.as_dict())
        cache = None if isinstance(cache, RowRollback) else cache  # a paged call's rows are the cache's to reset
        return build_output(rows, cfg, self.history, self.stats, cache, (self.want_scores, self.want_logits))

    def _prefill(self, ragged: RaggedCache, input_ids: torch.Tensor) -> None:
        start = ragged.cache.get_seq_length()
        if input_ids.shape[1] == 0:
            raise IncompatibleOptionsError("input_ids holds no tokens: give at least one (a BOS token to start afresh)")
        if start >= input_ids.shape[1]:
            raise IncompatibleOptionsError(
                f"the cache already holds {start} tokens and input_ids has {input_ids.shape[1]}: pass the whole "
                "sequence the cache holds plus at least one new token (as generate returns it), or a fresh cache"
            )
        t0 = time.perf_counter()
        with torch.no_grad():
            if self.screen is not None:
                hidden = ragged.feed(input_ids[:, start:], prefix=True, last=1, hidden=True)[:, -1]  # [B, E]
                tokens = self.screen.argmax(hidden.float())
            else:
                logits = ragged.feed(input_ids[:, start:], prefix=True, last=1)[:, -1].float()  # [B, V]
                scores = self._process(input_ids, logits)
                tokens = self._pick(scores)
        self.stats.verify_s += time.perf_counter() - t0
        self.stats.target_forwards += 1
        self.stats.row_forwards += input_ids.shape[0]
        self.last = tokens.tolist()
        for row, tok in enumerate(self.last):
            self._emit(row, [tok], [_NO_SCORES if self.screen is not None else (scores[row], logits[row])])

    def _emit(self, row: int, tokens: list[int], step_scores: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append tokens to a row one at a time through the stopping criteria (it may stop inside ``tokens``)."""
        rows = self.rows
        kept = 0
        for tok, sc in zip(tokens, step_scores, strict=True):
            rows.append(row, tok)
            kept += 1
            if self.want_scores or self.want_logits:
                self.history[row].append(sc)
            if bool(self.stopping(rows.ids(row), sc[0][None]).any()):
                rows.done[row] = True
                break
        if self.streamer is not None:
            self.streamer.put(torch.tensor(tokens[:kept]))
        self.stats.tokens += kept

    def _rooms(self, active: list[int]) -> list[int]:
        """Draft tokens each row may still take: what ``max_length`` leaves after this step's own token."""
        prompt_len = self.rows.prompt.shape[1]
        return [max(0, self.config.max_length - (prompt_len + len(self.rows.generated[r])) - 1) for r in active]

    def _step(self, ragged: RaggedCache, active: list[int]) -> list[int]:
        """One speculative step of the ``active`` rows: propose, verify in one target forward, emit, roll back."""
        t0 = time.perf_counter()
        live = [not self.rows.done[r] for r in active]  # finished rows still in the batch feed holes only
        proposals, lens = self._propose(active, live)
        t1 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        width = 1 + max(lens)
        chunk = torch.zeros(len(active), width, dtype=torch.long)  # [Ba, W]: the last token, then the drafts
        valid = torch.zeros(len(active), width, dtype=torch.bool)
        for i, (p, n) in enumerate(zip(proposals, lens, strict=True)):
            chunk[i, 0] = self.last[i]
            chunk[i, 1 : 1 + n] = p.tokens[:n]
            valid[i, : 1 + n] = live[i]
        logits, picked = self._score(ragged, chunk, valid)
        self.stats.target_forwards += 1
        self.stats.row_forwards += sum(live)
        verdicts = self._verify(active, proposals, lens, logits, live, picked)
        self.stats.verify_s += time.perf_counter() - t1
        drop, accepted = [], []
        for i, (row, v, n) in enumerate(zip(active, verdicts, lens, strict=True)):
            if v is None:  # a finished row waiting to leave the batch
                drop.append(0)
                accepted.append(0)
                continue
            self.stats.proposed += n
            self.stats.accepted += v.accepted
            accepted.append(v.accepted)
            self._emit(row, v.tokens, self._scores[i][: len(v.tokens)])
            drop.append(n - v.accepted)
            self.last[i] = v.tokens[-1]
        ragged.rollback(drop)
        self.strategy.observe(lens, accepted)
        self._learn(verdicts, lens, len(active) * width, time.perf_counter() - t0)
        return self._compact(ragged, active)

    def _propose(self, active: list[int], live: list[bool]) -> tuple[list[Proposal], list[int]]:
        """Each active row's proposal, and how many of its tokens go into this step's verification."""
        policy, rows = self.policy, self.rows
        rooms = self._rooms(active)
        ks = self.strategy.k.budgets()
        budgets = [min(b, room) if alive else 0 for b, room, alive in zip(ks, rooms, live, strict=True)]
        shadowed = policy is not None and self.strategy.shadow
        if policy is not None and not shadowed:  # a model draft costs work: decide before it drafts
            k = policy.choose(budgets, producing=sum(live))
            budgets = [min(b, k) for b in budgets]
        budgets = widen(budgets, rooms)
        # asked even with all-zero budgets, so stateful strategies see every step (they return empty proposals)
        proposals = self.strategy.propose([rows.sequence(r) for r in active], budgets)
        lens = [min(int(p.tokens.shape[0]), b) for p, b in zip(proposals, budgets, strict=True)]
        if shadowed:  # free proposals: decide with their real lengths; each is scored whole against the output
            k = policy.choose(lens, producing=sum(live))
            for i, (p, n) in enumerate(zip(proposals, lens, strict=True)):
                policy.shadow(i, p.tokens[:n].tolist())
            lens = [min(n, k) for n in lens]
        return proposals, lens

    def _score(
        self, ragged: RaggedCache, chunk: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The target's forward over ``chunk`` ``[Ba, W]``: its logits ``[Ba, W, V]``, or through the screened head
        each real position's argmax ``[Ba, W]`` (then no logits)."""
        device = self.rows.prompt.device
        with torch.no_grad():
            if self.screen is None:
                return ragged.feed(chunk.to(device), valid.to(device)).float(), None
            hidden = ragged.feed(chunk.to(device), valid.to(device), hidden=True)  # [Ba, W, E]
            picked = torch.zeros(chunk.shape, dtype=torch.long)  # [Ba, W]
            picked[valid] = self.screen.argmax(hidden[valid.to(device)].float()).cpu()
        return None, picked

    def _learn(self, verdicts: list[Verdict | None], lens: list[int], fed: int, seconds: float) -> None:
        """Tell the policy (if any) what the step cost and what each row gained."""
        policy = self.policy
        if policy is None:
            return
        policy.record_step(1, fed, seconds)
        policy.tick()
        for i, (v, n) in enumerate(zip(verdicts, lens, strict=True)):
            if v is None:
                continue
            if self.strategy.shadow:
                policy.produced(i, v.tokens)
            else:
                policy.observe(i, v.accepted, n)

    def _compact(self, ragged: RaggedCache, active: list[int]) -> list[int]:
        """The rows that go on: finished rows leave once at least half of the batch has finished (or all of it).

        Until then they stay as rows of holes: a decode step's matrix products are memory-bound, so a row costs
        almost nothing, while leaving it makes every following step run at an odd row count, which some BLAS
        kernels run far slower (measured on this CPU: the LM head at 7 rows 23 ms, at 8 rows 12 ms).
        """
        keep = [i for i, row in enumerate(active) if not self.rows.done[row]]
        if len(keep) == len(active) or (keep and (self._keeps_rows(active) or 2 * len(keep) > len(active))):
            return active
        self._select(ragged, keep, active)
        return [active[i] for i in keep]

    def _keeps_rows(self, active: list[int]) -> bool:
        """Whether finished rows stay in the batch for a kept cache (:meth:`RaggedCache.settle` lays it out only if
        every row is in it and generated as many tokens): while every finished row has used all its room. A row
        that stopped short (EOS, a stop string) means the cache will be emptied: rows may leave then."""
        if not self.publish:
            return False
        room = self.config.max_length - self.rows.prompt.shape[1]
        return all(len(self.rows.generated[r]) >= room for r in active if self.rows.done[r])

    def _select(self, ragged: RaggedCache, keep: list[int], active: list[int]) -> None:
        if keep:
            ragged.select(keep)
        self.strategy.select(keep)
        if self.policy is not None:
            self.policy.select(keep)
        self.last = [self.last[i] for i in keep]

    def _verify(
        self,
        active: list[int],
        proposals: list[Proposal],
        lens: list[int],
        logits: torch.Tensor | None,
        live: list[bool],
        picked: torch.Tensor | None = None,
    ) -> list[Verdict | None]:
        """Verdicts per row (``None`` for finished rows); also leaves per row the (scores, logits) of each chunk
        position in ``_scores``. ``logits [Ba, W, V]``: the chunk's logits; or ``None`` with ``picked [Ba, W]``,
        each position's argmax from the screened head (greedy, no processors: no scores to keep)."""
        fast = not self.sampling and not self.processors
        if picked is not None:
            greedy = picked  # [Ba, W]
        elif fast:
            greedy = logits.argmax(-1).cpu()  # [Ba, W]
        verdicts: list[Verdict | None] = []
        self._scores = []
        for i, (row, p, n) in enumerate(zip(active, proposals, lens, strict=True)):
            if not live[i]:
                verdicts.append(None)
                self._scores.append([])
                continue
            drafts = p.tokens[:n]
            if picked is not None:
                verdicts.append(verify_greedy(drafts, greedy[i, : n + 1]))
                self._scores.append([_NO_SCORES] * (n + 1))
                continue
            if fast:
                scores = logits[i, : n + 1]
                verdicts.append(verify_greedy(drafts, greedy[i, : n + 1]))
            else:
                draft_list = drafts.tolist()
                scores = torch.stack(
                    [
                        self._process_row(row, self.rows.ids(row, draft_list[:j]), logits[i, j][None])[0]
                        for j in range(n + 1)
                    ]
                )  # [n + 1, V]
                if self.sampling:
                    q = p.probs[:n] if p.probs is not None else None
                    verdicts.append(verify_sampling(drafts.to(scores.device), scores.softmax(-1), q))
                else:
                    verdicts.append(verify_greedy(drafts, scores.argmax(-1).cpu()))
            self._scores.append([(scores[j], logits[i, j]) for j in range(n + 1)])
        return verdicts


def _check_scores(config: Any, batch: int, criteria: Any) -> None:
    """Per-step scores / logits of a batch whose rows may finish at different steps: Transformers goes on computing
    a finished row's (over its padding); speculative generation drops the row instead.

    Raises:
        IncompatibleOptionsError: ``output_scores`` / ``output_logits`` with more than one row and an EOS token,
            stop strings or another per-row stopping criterion.
    """
    asked = [f for f in ("output_scores", "output_logits") if getattr(config, f, False)]
    per_row = per_row_criteria(criteria)
    if asked and config.return_dict_in_generate and batch > 1 and (eos_token_ids(config.eos_token_id) or per_row):
        raise IncompatibleOptionsError(
            f"speculative generation cannot return {' / '.join(asked)} for a batch of {batch} rows that may finish "
            "at different steps (on EOS or a stop string, it stops computing a finished row; Transformers goes on "
            "over its padding): pass one prompt per call, or drop the speculative keyword for this call"
        )


def make_custom_generate(strategy: Strategy, streamer: Any, on_stats: Callable[[SpeculativeStats], None]) -> Callable:
    """A ``custom_generate`` callable for ``generate`` that runs :class:`_Loop` with ``strategy``.

    ``streamer`` is passed here because Transformers hands custom decoding methods no streamer (it calls
    ``streamer.put`` on the prompt itself; this loop puts the new tokens and calls ``end``).
    """

    def speculative_decoding(
        model: nn.Module,
        input_ids: torch.LongTensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        **model_kwargs: Any,
    ) -> Any:
        for flag in ("output_attentions", "output_hidden_states"):
            if getattr(generation_config, flag, False):
                raise IncompatibleOptionsError(f"speculative generation does not return {flag.removeprefix('output_')}")
        _check_scores(generation_config, input_ids.shape[0], stopping_criteria)
        if input_ids.shape[0] > 1 and finished_rows_go_on(stopping_criteria):
            raise IncompatibleOptionsError(
                "speculative generation stops computing a row once a stop string or stopping criterion finishes it; "
                "without an EOS token Transformers' decoding goes on generating that row until every row has "
                "finished, so a batch's outputs would differ: set eos_token_id, pass one prompt per call, or drop the "
                "speculative keyword for this call"
            )
        if model_kwargs.get("inputs_embeds") is not None:
            raise IncompatibleOptionsError("speculative generation needs input_ids (inputs_embeds are not supported)")
        loop = _Loop(model, strategy, logits_processor, stopping_criteria, generation_config, streamer)
        try:
            with claimed(strategy):  # a Strategy holds per-call state: one call at a time (typed error otherwise)
                return loop.run(input_ids, model_kwargs)
        finally:
            on_stats(loop.stats)

    return speculative_decoding
