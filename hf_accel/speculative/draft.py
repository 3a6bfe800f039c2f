"""Model-based drafting: a smaller model (:class:`DraftModel`) or a cheaper copy of the target
(:class:`SelfSpeculative`).

The draft keeps its own cache over the same ragged rows as the target (:class:`.ragged.RaggedCache`): each
step it first feeds what it has not seen of every row (the target's last token, and a fully accepted
proposal's final draft), then proposes autoregressively; after verification it rolls back each row to the
accepted prefix. In sampling mode it samples from its own processed distribution and hands those
probabilities to the verifier (rejection sampling needs them). Its steps and catch-ups run through a
:class:`.lean.LeanStep` where the draft's architecture allows (Llama family), else through its own forward, over
a cache that appends in place (:mod:`.growing`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.config import Int8Config
from ..core.dispatch import is_offloaded, is_sharded, model_dtype
from ..core.errors import IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.registry import get_spec, parent_and_name
from ..core.state import plain_copy
from ..quant.apply import quantize_linears
from .growing import growing_cache, to_growing
from .lean import LeanStep
from .ragged import LEAN_MAX_WIDTH, RaggedCache
from .strategies import PromptLookup, Proposal, Strategy

__all__ = ["DraftModel", "SelfSpeculative"]

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
        self._step = LeanStep.build(model)
        self._ragged = RaggedCache(
            model,
            growing_cache(model.config),
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
        from .loop import row_independent

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


def _check_layers(layers: Iterable[int] | None) -> tuple[int, ...] | None:
    """``layers`` as sorted distinct indices, or ``None``; a typed error for anything else."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise IncompatibleOptionsError(f"SelfSpeculative.layers must be decoder-layer indices, got {layers!r}")
    values = list(layers)
    if not values:
        raise IncompatibleOptionsError("SelfSpeculative.layers is empty: keep at least one decoder layer")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise IncompatibleOptionsError(f"SelfSpeculative.layers must be non-negative integers, got {bad[0]!r}")
    if len(set(values)) != len(values):
        raise IncompatibleOptionsError(f"SelfSpeculative.layers lists a layer twice: {values}")
    return tuple(sorted(values))


def _keep_layers(model: nn.Module, keep: Sequence[int]) -> bool:
    """Cut a private copy down to the decoder layers ``keep`` (sorted), renumbered 0..len(keep)-1; whether any
    layer was dropped.

    Every ``layer_idx`` inside a kept layer (the index it uses in the cache) and the config's per-layer fields
    follow the new numbering, so a fresh cache built from the copy's config matches it.
    """
    holder, name = parent_and_name(model, get_spec(model).layers)
    stack = getattr(holder, name)
    if keep[-1] >= len(stack):
        raise IncompatibleOptionsError(
            f"SelfSpeculative.layers names layer {keep[-1]}, but the model has {len(stack)} decoder layers "
            f"(0..{len(stack) - 1})"
        )
    if len(keep) == len(stack):
        return False
    kept = [stack[i] for i in keep]
    for new, layer in enumerate(kept):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new
    setattr(holder, name, nn.ModuleList(kept))
    config = model.config
    config.num_hidden_layers = len(keep)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in keep]
    return True


def _from_paged(draft: nn.Module, paged: Any, mask: torch.Tensor, layers: Sequence[int] | None) -> Any:
    """A growing ``DynamicCache`` for ``draft`` holding the paged cache's prompt K/V padded as ``mask`` (the kept
    ``layers`` only, renumbered), or ``None`` where the draft's cache has other than full-attention layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=draft.config)
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [None])):
        return None  # sliding windows and other layer kinds: the draft runs its prompt itself
    device = _device(draft)
    for new, old in enumerate(layers if layers is not None else range(len(cache.layers))):
        keys, values = paged.dense(old, mask)  # [B, H_kv, T, D] each
        cache.update(keys.to(device), values.to(device), new)
    return to_growing(cache)


class SelfSpeculative(DraftModel):
    """Drafts with a cheaper private copy of the target itself: its weights in int8 or a lower precision,
    and/or a subset of its decoder layers.

    The copy is made on the first call for a given target and kept (it costs memory: ~1/4 of the target's
    linear weights with int8). Acceptance is high because the copy is the same model; the speed-up comes
    from the copy's faster decode steps (int8 reads a quarter of the bytes; each dropped layer saves its share).

    Args:
        weights: ``"int8"`` (hf_accel's weight-only int8 kernel), a ``torch.dtype`` such as ``torch.bfloat16``, or
            ``None`` (the target's own weights; then ``layers`` must drop some).
        num_tokens / adaptive / max_tokens / fallback: see :class:`~.strategies.Strategy`; lookup: see
            :class:`DraftModel`.
        layers: indices of the decoder layers the copy keeps (e.g. ``range(0, 30, 2)``), in the target's
            numbering; ``None`` keeps them all. Checked against the model on the first call.

    Raises:
        IncompatibleOptionsError: an unknown ``weights``, ``layers`` empty / not distinct non-negative integers,
            neither option making the copy cheaper, or (at the call) a layer index the model does not have.
    """

    name = "self"

    def __init__(
        self,
        weights: str | torch.dtype | None = "int8",
        num_tokens: int = 6,
        adaptive: bool = True,
        max_tokens: int | None = None,
        fallback: bool = False,
        layers: Iterable[int] | None = None,
        lookup: bool = True,
    ) -> None:
        Strategy.__init__(self, num_tokens, adaptive, max_tokens, fallback)
        self._lookups(lookup)
        if weights is not None and weights != "int8" and not isinstance(weights, torch.dtype):
            raise IncompatibleOptionsError(
                f"SelfSpeculative.weights must be 'int8', a torch.dtype or None, got {weights!r}"
            )
        self.layers = _check_layers(layers)
        if weights is None and self.layers is None:
            raise IncompatibleOptionsError(
                "SelfSpeculative needs something cheaper than the target: weights='int8' or a dtype, and/or layers=..."
            )
        self.weights = weights
        self.draft = None
        self._for: int | None = None

    def _check(self, target: nn.Module) -> None:
        return None  # the copy shares the target's vocabulary and device by construction

    def prefilled(self, ragged: RaggedCache) -> None:
        """Start the draft from a copy of the target's prompt cache instead of running the prompt again.

        The copy has the target's architecture, so the target's keys/values fit it; it only proposes, so reading
        the target's values for the prompt changes how well it guesses, never the output. From the paged cache
        (rows stored without padding in the target's pool) each row's tokens are gathered into the padded layout
        (:meth:`~hf_accel.paged.cache.PagedCache.dense`). Left to its own prefill for a draft in another dtype,
        and from the paged cache for a draft whose cache has sliding-window or other non-full-attention layers.
        """
        draft = self._ragged.model
        if model_dtype(draft) != model_dtype(ragged.model):
            return
        cache = ragged.cache
        if ragged.paged:
            seeded = _from_paged(draft, cache, ragged.mask, self.layers)
            if seeded is not None:
                self._ragged = RaggedCache(draft, seeded, ragged.mask.clone(), self._step)
                self._seen = ragged.real_lengths().tolist()
            return
        if self.layers is not None:  # the kept layers' entries, renumbered like the copy's layers
            if len(getattr(cache, "layers", ())) <= max(self.layers):
                return
            subset = copy.copy(cache)
            subset.layers = [cache.layers[i] for i in self.layers]
            cache = subset
        self._ragged = RaggedCache(draft, to_growing(copy.deepcopy(cache)), ragged.mask.clone(), self._step)
        self._seen = ragged.real_lengths().tolist()

    def _draft_for(self, target: nn.Module) -> nn.Module:
        if self.draft is None or self._for != id(target):
            self.draft = self.build(target, self.weights, self.layers)
            self._for = id(target)
        return self.draft

    @staticmethod
    def build(target: nn.Module, weights: str | torch.dtype | None, layers: Sequence[int] | None = None) -> nn.Module:
        """The cheaper copy of ``target`` (a private deep copy; the target is not touched).

        Args:
            target: the (patched) model to copy.
            weights: ``"int8"``, a ``torch.dtype`` or ``None`` (keep the target's).
            layers: sorted indices of the decoder layers to keep, or ``None`` for all.

        Raises:
            IncompatibleOptionsError: offloaded / sharded weights, or a layer index the model does not have.
        """
        if is_offloaded(target) or any(is_sharded(p) for p in target.parameters()):
            raise IncompatibleOptionsError(
                "self-speculation copies the model's weights, but this model's are offloaded by accelerate or "
                "sharded by tensor parallelism; speculate with prompt_lookup=True or a separate draft_model"
            )
        draft = plain_copy(target)  # every feature's instance changes undone on the copy; the target untouched
        if not (_keep_layers(draft, layers) if layers is not None else False) and weights is None:
            raise IncompatibleOptionsError(
                "SelfSpeculative(weights=None) keeps every decoder layer: the draft would be the target itself; "
                "drop some layers or pick cheaper weights"
            )
        if weights == "int8":  # the int8 feature's own swap, on the copy (its float weights are released)
            quantize_linears(draft, get_spec(draft), Int8Config(), Recorder())
        elif weights is not None:
            draft.to(weights)
        logger.info(
            "hf_accel: built a self-speculative draft of %s (weights %s, layers %s)",
            type(target).__name__,
            weights if weights is not None else "unchanged",
            "all" if layers is None else list(layers),
        )
        return draft.eval()

    def __repr__(self) -> str:
        kept = "" if self.layers is None else f", layers={list(self.layers)}"
        return (
            f"SelfSpeculative(weights={self.weights!r}, num_tokens={self.k.num_tokens}, adaptive={self.k.adaptive}"
            f"{kept}{'' if self.lookup else ', lookup=False'})"
        )
