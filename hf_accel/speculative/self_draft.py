"""Self-speculation: the draft is a cheaper private copy of the target itself (:class:`SelfSpeculative`), made with
the patch's own tools: :func:`hf_accel.core.state.plain_copy` undoes every feature on the copy, and the int8 feature's
:func:`~hf_accel.quant.apply.quantize_linears` quantizes it."""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.call import device_of
from ..core.config import Int8Config
from ..core.dispatch import is_offloaded, is_sharded, model_dtype
from ..core.errors import IncompatibleOptionsError
from ..core.fingerprint import tensor_version
from ..core.recorder import Recorder
from ..core.registry import experts_modules, get_spec, parent_and_name
from ..core.state import plain_copy
from ..native.growing import to_growing
from ..quant.apply import int8_targets, quantize_linears
from ..quant.experts import quantize_experts
from .draft import DraftModel
from .ragged import RaggedCache
from .strategies import Strategy

__all__ = ["SelfSpeculative"]

logger = logging.getLogger("hf_accel.speculative")


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
    device = device_of(draft)
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
        self._for: weakref.ref[nn.Module] | None = None  # the target the draft was built from
        self._built_from: tuple = ()  # the target's parameters then (_weights_key): rebuilt when they change

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

    def adopt_draft(self, other: SelfSpeculative) -> None:
        """Share ``other``'s draft copy when it has the same options (strategies lent to concurrent calls: one copy
        in memory; the copy only runs forwards, each strategy keeps its own cache)."""
        if (other.weights, other.layers) == (self.weights, self.layers) and other.draft is not None:
            self.draft, self._for, self._built_from = other.draft, other._for, other._built_from

    def _draft_for(self, target: nn.Module) -> nn.Module:
        key = _weights_key(target)
        if self.draft is None or self._for is None or self._for() is not target or key != self._built_from:
            # a new target, or its parameters changed since (load_state_dict, an optimizer step,
            # resize_token_embeddings, model.to(...)): a copy of the old ones may be of another vocabulary or device
            self.draft = self.build(target, self.weights, self.layers)
            self._for, self._built_from = weakref.ref(target), key
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
        # every feature's instance changes undone on the copy, the target untouched; a mixture of experts' experts
        # (float, or an int8 target's Int8Experts) are shared, not copied: most of such a model's bytes. An int8 draft
        # then builds int8 experts of its own from float ones (a quarter of the bytes to read), a dtype draft
        # converts a copy.
        experts = experts_modules(target, get_spec(target)) if not isinstance(weights, torch.dtype) else []
        draft = plain_copy(target, share=[t for module in experts for t in (*module.parameters(), *module.buffers())])
        cut = _keep_layers(draft, layers) if layers is not None else False
        if not cut and weights is None:
            raise IncompatibleOptionsError(
                "SelfSpeculative(weights=None) keeps every decoder layer: the draft would be the target itself; "
                "drop some layers or pick cheaper weights"
            )
        if weights == "int8":  # the int8 feature's own swap, on the copy (its float weights are released)
            floats = len(int8_targets(draft, get_spec(draft), Int8Config()))
            quantize_linears(draft, get_spec(draft), Int8Config(), Recorder())
            experts, kept = quantize_experts(draft, get_spec(draft))  # int8 experts of its own, from float ones
            floats += experts
            if kept:
                logger.warning("hf_accel: the int8 draft keeps its experts in float (%s)", "; ".join(kept))
            if not floats and not cut:
                raise IncompatibleOptionsError(
                    "SelfSpeculative(weights='int8') of a model whose linears (and experts) are int8 already: the "
                    "draft would be the target itself; cut layers (layers=[...]), or use prompt_lookup=True or a "
                    "draft_model"
                )
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


def _weights_key(target: nn.Module) -> tuple:
    """What the draft copy was built from: each parameter's storage, version counter, shape, dtype and device (an
    in-place edit, a replaced or resized tensor, a cast or a move changes it; buffers are left out, since some rotary
    embeddings rewrite theirs at every forward). A write through ``.data`` is not seen: a stale copy only guesses
    worse, the target verifies every token."""
    return tuple(
        (name, p.data_ptr(), tensor_version(p), tuple(p.shape), p.dtype, p.device)
        for name, p in target.named_parameters()
    )
