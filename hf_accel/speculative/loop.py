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

import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleOptionsError
from ..core.protocols import RowRollback
from .policy import SpeculationPolicy
from .ragged import RaggedCache
from .screen import HeadScreen
from .strategies import Proposal, Strategy
from .verify import Verdict, verify_greedy, verify_sampling

__all__ = ["SpeculativeStats", "make_custom_generate"]

logger = logging.getLogger("hf_accel.speculative")

#: the (scores, logits) the stopping criteria see for a token picked through the screened head: none were computed,
#: and the screen only runs with criteria that do not read them
_NO_SCORES = (torch.empty(0), torch.empty(0))


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


class _Rows:
    """Per-row sequences of the batch: the padded prompt, the real tokens, and what was generated."""

    def __init__(self, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.prompt = input_ids  # [B, P] as given (left padded)
        self.real = [row[m.bool()].cpu() for row, m in zip(input_ids, mask, strict=True)]  # [L_i] each
        self.generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        self.done = [False] * input_ids.shape[0]

    def ids(self, row: int, extra: Sequence[int] = ()) -> torch.Tensor:
        """``[1, P + g + len(extra)]``: what plain decoding's ``input_ids`` holds for this row."""
        tail = torch.tensor([*self.generated[row], *extra], dtype=torch.long, device=self.prompt.device)
        return torch.cat([self.prompt[row], tail])[None]

    def sequence(self, row: int) -> torch.Tensor:
        """The row's real tokens so far (prompt without padding, then generated), ``[L]`` on CPU."""
        return torch.cat([self.real[row], torch.tensor(self.generated[row], dtype=torch.long)])


@functools.cache
def _row_independent_types() -> tuple[type, ...]:
    import transformers.generation.logits_process as lp

    names = [
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "TopHLogitsWarper",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "InfNanRemoveLogitsProcessor",
        "RepetitionPenaltyLogitsProcessor",
    ]
    return tuple(getattr(lp, n) for n in names if hasattr(lp, n))


def row_independent(processor: Any) -> bool:
    """Whether ``processor`` treats every row alone (no per-batch-index state): it may then be called on one row.

    Others (user processors, prefix constraints, a repetition penalty with a per-row prompt length) are called
    on the full original batch with the row replicated, and the row is read back at its own index.
    """
    if not isinstance(processor, _row_independent_types()):
        return False
    return not isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor)


def _has_sliding_layers(cache: Any) -> bool:
    return any(getattr(layer, "sliding_window", None) for layer in getattr(cache, "layers", []))


def _check_cache(model: nn.Module, cache: Any, max_length: int) -> None:
    if isinstance(cache, RowRollback):  # hf_accel's PagedCache: per-row rollback, any window
        return
    if _is_static(cache) or not hasattr(cache, "crop"):
        raise IncompatibleOptionsError(
            "speculative generation needs a cache that can roll back (DynamicCache or hf_accel.PagedCache), "
            f"got {type(cache).__name__}; drop cache_implementation= or pass paged=True"
        )
    window = getattr(model.config, "sliding_window", None)
    if _has_sliding_layers(cache) and window is not None and max_length > window:
        raise IncompatibleOptionsError(
            f"speculative generation past the sliding window ({max_length} > {window} tokens) needs the paged "
            "cache: pass paged=True (Transformers' sliding-window cache layers cannot roll back there)"
        )


def _is_static(cache: Any) -> bool:
    from transformers import StaticCache

    return isinstance(cache, StaticCache)


#: the head screens built so far, per LM head module: ``((weight pointer, version), screen)``
_SCREENS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], HeadScreen]] = weakref.WeakKeyDictionary()


def head_screen(model: nn.Module) -> HeadScreen | None:
    """The int8 screen of ``model``'s LM head (built once, cached while the weight is unchanged), or ``None`` where
    it does not apply: the logits must be exactly ``lm_head(model.model(...))`` (the lean draft architectures,
    forward not replaced on the instance, no hooks), the head a float32 ``nn.Linear`` on the CPU, and the W8A16
    kernel (AVX-512 VNNI build of the draft's native layers) available for its width; not under tensor parallelism."""
    from ..core.dispatch import is_tensor_parallel
    from .lean import LEAN_MODEL_TYPES, has_hooks, native_module

    head = getattr(model, "lm_head", None)
    if getattr(model.config, "model_type", None) not in LEAN_MODEL_TYPES or "forward" in vars(model):
        return None
    if is_tensor_parallel(model):  # a tensor-parallel head gathers its output across ranks
        return None
    if type(head) is not nn.Linear or not isinstance(getattr(model, "model", None), nn.Module):
        return None
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % 32:
        return None
    if has_hooks((model, head)):
        return None
    key = (weight.data_ptr(), weight._version)
    cached = _SCREENS.get(head)
    if cached is not None and cached[0] == key:
        return cached[1]
    module = native_module({int(weight.shape[1])}, "avx512vnni")
    if module is None or not module.vnni() or not module.w8a16_fits(weight.shape[1], 1):
        return None
    screen = HeadScreen.build(weight, head.bias, module.w8a16_linear)
    _SCREENS[head] = (key, screen)
    return screen


def target_step(model: nn.Module) -> Any:
    """The target's verification chunks and prompt through the draft's native layers (:class:`~.lean.LeanStep` with
    float32 K/V over a growing cache; one C++ call for all decoder layers instead of ~30 module calls, ~12% of a 4 x 13
    chunk on SmolLM2), or ``None`` where they do not apply: the lean architectures with native layers for this model
    (float32 on the CPU, projections and MLPs they know), no hooks, no tensor-parallel shards, ``forward`` not
    replaced on the instance."""
    from .lean import LeanStep

    if "forward" in vars(model):
        return None
    step = LeanStep.build(model, kv_dtype=torch.float32)
    return step if step is not None and step.native is not None else None


@functools.cache
def _scoreless_criteria() -> tuple[type, ...]:
    from transformers.generation import stopping_criteria as sc

    names = ("MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria", "StopStringCriteria")
    return tuple(getattr(sc, n) for n in names if hasattr(sc, n))


def _scoreless(criterion: Any) -> bool:
    """Whether a stopping criterion never reads the scores (the screened head computes none): Transformers' length,
    time, EOS and stop-string criteria, or one that says so with ``reads_scores = False``."""
    return type(criterion) in _scoreless_criteria() or getattr(criterion, "reads_scores", True) is False


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
        self.policy: SpeculationPolicy | None = None
        self.want_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.want_logits = bool(config.return_dict_in_generate and config.output_logits)
        #: greedy argmax through the int8-screened head where nothing needs the scores (:mod:`.screen`)
        self.screen: HeadScreen | None = None
        if (
            strategy.screen_head
            and not self.sampling
            and not self.processors
            and not (self.want_scores or self.want_logits)
            and all(_scoreless(c) for c in stopping)
        ):
            self.screen = head_screen(model)

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
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        _check_cache(self.model, cache, cfg.max_length)
        step = None
        if type(cache) is DynamicCache:  # its full-attention layers append in place from here on (same contract)
            from .growing import to_growing

            to_growing(cache)
            step = target_step(self.model)
            if step is not None and not step.native.serves(cache):
                step = None  # e.g. sliding-window layers: the model's own forward runs every chunk
        rows = _Rows(input_ids, mask)
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
        finally:
            self.strategy.finish()
            if self.policy is not None:
                self.stats.plain_steps = self.policy.plain_steps
            if isinstance(cache, RowRollback):
                cache.reset()  # rows were re-indexed as they finished: nothing of them is published
        if self.streamer is not None:
            self.streamer.end()
        logger.debug("speculative generate: %s", self.stats.as_dict())
        return self._output(cache)

    def _prefill(self, ragged: RaggedCache, input_ids: torch.Tensor) -> None:
        start = ragged.cache.get_seq_length()
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
            rows.generated[row].append(tok)
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

    @staticmethod
    def _widen(budgets: list[int], rooms: list[int]) -> list[int]:
        """Every drafting row's budget raised to the widest one (within its room): the verification chunk is as
        wide as its widest row and computes the narrower rows' padding anyway, and a model draft feeds the whole
        batch until its widest row is done, so the extra guesses cost nothing and may be accepted. Rows not drafting
        this step (budget 0: paused, finished) stay at 0."""
        widest = max(budgets, default=0)
        return [min(widest, room) if b > 0 else 0 for b, room in zip(budgets, rooms, strict=True)]

    def _step(self, ragged: RaggedCache, active: list[int]) -> list[int]:
        rows, policy = self.rows, self.policy
        t0 = time.perf_counter()
        live = [not rows.done[r] for r in active]  # finished rows still in the batch feed holes only
        rooms = self._rooms(active)
        ks = self.strategy.k.budgets()
        budgets = [min(b, room) if alive else 0 for b, room, alive in zip(ks, rooms, live, strict=True)]
        shadowed = policy is not None and self.strategy.shadow
        if policy is not None and not shadowed:  # a model draft costs work: decide before it drafts
            k = policy.choose(budgets, producing=sum(live))
            budgets = [min(b, k) for b in budgets]
        budgets = self._widen(budgets, rooms)
        # asked even with all-zero budgets, so stateful strategies see every step (they return empty proposals)
        proposals = self.strategy.propose([rows.sequence(r) for r in active], budgets)
        t1 = time.perf_counter()
        self.stats.draft_s += t1 - t0
        lens = [min(int(p.tokens.shape[0]), b) for p, b in zip(proposals, budgets, strict=True)]
        if shadowed:  # free proposals: decide with their real lengths; each is scored whole against the output
            k = policy.choose(lens, producing=sum(live))
            for i, (p, n) in enumerate(zip(proposals, lens, strict=True)):
                policy.shadow(i, p.tokens[:n].tolist())
            lens = [min(n, k) for n in lens]
        width = 1 + max(lens)
        device = rows.prompt.device
        chunk = torch.zeros(len(active), width, dtype=torch.long)
        valid = torch.zeros(len(active), width, dtype=torch.bool)
        for i, (p, n) in enumerate(zip(proposals, lens, strict=True)):
            chunk[i, 0] = self.last[i]
            chunk[i, 1 : 1 + n] = p.tokens[:n]
            valid[i, : 1 + n] = live[i]
        with torch.no_grad():
            logits = picked = None
            if self.screen is not None:  # the argmax of each real position, without forming the logits
                hidden = ragged.feed(chunk.to(device), valid.to(device), hidden=True)  # [Ba, W, E]
                picked = torch.zeros(len(active), width, dtype=torch.long)  # [Ba, W]
                picked[valid] = self.screen.argmax(hidden[valid.to(device)].float()).cpu()
            else:
                logits = ragged.feed(chunk.to(device), valid.to(device)).float()  # [Ba, W, V]
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
        if policy is not None:
            policy.record_step(len(active), width, time.perf_counter() - t0)
            policy.tick()
            for i, (v, n) in enumerate(zip(verdicts, lens, strict=True)):
                if v is None:
                    continue
                if shadowed:
                    policy.produced(i, v.tokens)
                else:
                    policy.observe(i, v.accepted, n)
        return self._compact(ragged, active)

    def _compact(self, ragged: RaggedCache, active: list[int]) -> list[int]:
        """The rows that go on: finished rows leave once at least half of the batch has finished (or all of it).

        Until then they stay as rows of holes: a decode step's matrix products are memory-bound, so a row costs
        almost nothing, while leaving it makes every following step run at an odd row count, which some BLAS
        kernels run far slower (measured on this CPU: the LM head at 7 rows 23 ms, at 8 rows 12 ms).
        """
        keep = [i for i, row in enumerate(active) if not self.rows.done[row]]
        if len(keep) == len(active) or (keep and 2 * len(keep) > len(active)):
            return active
        self._select(ragged, keep, active)
        return [active[i] for i in keep]

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

    # ------------------------------------------------------------------------------------- output
    def _output(self, cache: Any) -> Any:
        rows, cfg = self.rows, self.config
        longest = max(len(g) for g in rows.generated)
        pad = cfg._pad_token_tensor
        pad_id = int(pad) if pad is not None else 0
        tail = torch.full((len(rows.generated), longest), pad_id, dtype=torch.long)
        for i, g in enumerate(rows.generated):
            tail[i, : len(g)] = torch.tensor(g, dtype=torch.long)
        sequences = torch.cat([rows.prompt, tail.to(rows.prompt.device)], 1)
        if not cfg.return_dict_in_generate:
            return sequences
        from .output import SpeculativeGenerateOutput

        def stacked(which: int) -> tuple[torch.Tensor, ...] | None:
            if not (self.want_scores if which == 0 else self.want_logits):
                return None
            steps = []
            for t in range(longest):
                ref = next(h[t][which] for h in self.history.values() if len(h) > t)
                steps.append(
                    torch.stack([h[t][which] if len(h) > t else torch.zeros_like(ref) for h in self.history.values()])
                )
            return tuple(steps)

        return SpeculativeGenerateOutput(
            sequences=sequences,
            scores=stacked(0),
            logits=stacked(1),
            cache=None if isinstance(cache, RowRollback) else cache,
            speculative=self.stats.as_dict(),
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
        if model_kwargs.get("inputs_embeds") is not None:
            raise IncompatibleOptionsError("speculative generation needs input_ids (inputs_embeds are not supported)")
        loop = _Loop(model, strategy, logits_processor, stopping_criteria, generation_config, streamer)
        try:
            return loop.run(input_ids, model_kwargs)
        finally:
            on_stats(loop.stats)

    return speculative_decoding
