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

from ..dispatch import model_dtype
from ..errors import IncompatibleOptionsError
from .growing import growing_cache, to_growing
from .lean import LeanStep
from .ragged import RaggedCache
from .strategies import Proposal, Strategy

__all__ = ["DraftModel", "SelfSpeculative"]

logger = logging.getLogger("hf_accel.speculative")


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _vocab(model: nn.Module) -> int:
    out = model.get_output_embeddings()
    return int(out.weight.shape[0]) if out is not None and hasattr(out, "weight") else int(model.config.vocab_size)


class DraftModel(Strategy):
    """Drafts with a smaller causal LM that shares the target's tokenizer.

    Args:
        draft: the draft model (same vocabulary, same device as the target).
        num_tokens: initial draft tokens per step.
        adaptive / max_tokens / fallback: see :class:`~.strategies.Strategy`. ``fallback`` is off by default
            for model drafts: after a pause the draft must catch up on every token it missed, which makes the
            first step after a pause look slow and re-triggers the pause (measured: int8 self-speculation on
            chat prompts fell from 1.3-1.8x to 0.86x with it on); their per-row adaptive ``k`` pauses instead.

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
    ) -> None:
        super().__init__(num_tokens, adaptive, max_tokens, fallback)
        if not isinstance(draft, nn.Module) or not hasattr(draft, "config"):
            raise IncompatibleOptionsError(f"draft_model must be a Transformers causal LM, got {type(draft).__name__}")
        self.draft = draft

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
        self._fed = 0  # draft tokens fed back in the last propose (rolled back per row by observe)

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
        ragged = self._ragged
        device = _device(ragged.model)
        k = max(budgets)
        if k == 0:
            self._fed = 0
            return [Proposal.empty() for _ in sequences]
        # catch up: every row's tokens the draft has not seen, left-padded into one chunk
        unseen = [seq[n:] for seq, n in zip(sequences, self._seen, strict=True)]
        width = max(u.shape[0] for u in unseen)
        chunk = torch.zeros(len(unseen), width, dtype=torch.long)
        valid = torch.zeros(len(unseen), width, dtype=torch.bool)
        for i, u in enumerate(unseen):
            chunk[i, width - u.shape[0] :] = u
            valid[i, width - u.shape[0] :] = True
        contexts = [seq.to(device) for seq in sequences]
        tokens, probs = [], []
        with torch.no_grad():
            logits = ragged.feed(chunk.to(device), valid.to(device), last_only=True)[:, -1]
            for step in range(k):
                tok, p = self._pick(contexts, logits)
                tokens.append(tok.cpu())
                probs.append(p)
                if step + 1 < k:
                    contexts = [torch.cat([c, t[None]]) for c, t in zip(contexts, tok, strict=True)]
                    logits = ragged.feed(tok[:, None], last_only=True)[:, -1]
        self._seen = [seq.shape[0] + k - 1 for seq in sequences]
        self._fed = k - 1
        drafts = torch.stack(tokens, 1)  # [B, k]
        stacked = torch.stack(probs, 1) if self.sampling else None  # [B, k, V]
        return [Proposal(drafts[i, :b], stacked[i, :b] if stacked is not None else None) for i, b in enumerate(budgets)]

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        if self._fed:
            keep = [min(a, self._fed) for a in accepted]
            drop = [self._fed - kept for kept in keep]
            self._ragged.rollback(drop)
            self._seen = [n - d for n, d in zip(self._seen, drop, strict=True)]
            self._fed = 0
        super().observe(proposed, accepted)

    def select(self, keep: Sequence[int]) -> None:
        super().select(keep)
        if keep:
            self._ragged.select(keep)
        self._seen = [self._seen[i] for i in keep]

    def __repr__(self) -> str:
        return f"DraftModel({type(self.draft).__name__}, num_tokens={self.k.num_tokens}, adaptive={self.k.adaptive})"


class _GatedMLP(nn.Module):
    """``down(act(gate) * up)`` with ``[gate, up] = gate_up(x)``: a fused MLP whose projections are modules."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, act: nn.Module, intermediate: int) -> None:
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn, self.intermediate = gate_up, down, act, intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)  # each [..., I]
        return self.down_proj(self.act_fn(gate) * up)


def _quantize_copy(model: nn.Module) -> None:
    """Swap every ``nn.Linear`` (and fused MLP) of a private copy for int8 (lossy; the draft only proposes)."""
    from ..fused.mlp import FusedGatedMLP
    from ..quant import Int8Linear

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, FusedGatedMLP):
                weight = child.gate_up_weight
                lin = nn.Linear(weight.shape[1], weight.shape[0], bias=child.gate_up_bias is not None)
                lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
                if child.gate_up_bias is not None:
                    lin.bias = nn.Parameter(child.gate_up_bias.detach(), requires_grad=False)
                mlp = _GatedMLP(Int8Linear.from_module(lin), child.down_proj, child.act_fn, child.intermediate_size)
                setattr(module, child_name, mlp)
        del name
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8Linear.from_module(child))


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
    from ..registry import get_spec, parent_and_name

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
        num_tokens / adaptive / max_tokens / fallback: see :class:`~.strategies.Strategy`.
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
    ) -> None:
        Strategy.__init__(self, num_tokens, adaptive, max_tokens, fallback)
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
        from ..dispatch import is_offloaded, is_sharded
        from ..patch import _STATE_ATTR

        if is_offloaded(target) or any(is_sharded(p) for p in target.parameters()):
            raise IncompatibleOptionsError(
                "self-speculation copies the model's weights, but this model's are offloaded by accelerate or "
                "sharded by tensor parallelism; speculate with prompt_lookup=True or a separate draft_model"
            )
        draft = copy.deepcopy(target)
        for attr in ("generate", _STATE_ATTR):  # the copy is a plain model, not a patched one
            draft.__dict__.pop(attr, None)
        impl = getattr(draft.config, "_attn_implementation", None) or ""
        if impl.startswith("hf_accel_paged:"):
            draft.config._attn_implementation = impl.split(":", 1)[1]
        from ..fused.packed import unpack_linears

        unpack_linears(draft)  # pre-packed weights (compile feature) back to plain linears before re-typing
        if not (_keep_layers(draft, layers) if layers is not None else False) and weights is None:
            raise IncompatibleOptionsError(
                "SelfSpeculative(weights=None) keeps every decoder layer: the draft would be the target itself; "
                "drop some layers or pick cheaper weights"
            )
        if weights == "int8":
            _quantize_copy(draft)
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
            f"{kept})"
        )
