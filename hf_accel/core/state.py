"""What a patch keeps on one model instance, the features a patch can apply, and plain copies of patched models.

:class:`PatchState` lives in the patched model's ``__dict__`` under :data:`STATE_ATTR`; every layer reaches it
through :func:`get_state`. It carries the available :class:`Feature` table, so the ``generate`` wrapper and the
features never import the top-level ``patch`` module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .call import GenerateCall, GenerateKwarg
from .recorder import Recorder
from .registry import ModelParts

__all__ = ["STATE_ATTR", "Feature", "PatchState", "get_state", "plain_copy"]

#: The instance attribute holding a patched model's :class:`PatchState`.
STATE_ATTR = "_hf_accel_state"

Applier = Callable[[nn.Module, ModelParts, Any, Recorder], None]


@dataclass(frozen=True)
class Feature:
    """One feature of the plugin.

    Args:
        apply: ``apply(model, parts, config, recorder)`` patches the instance (every change through ``recorder``);
            ``None``: not implemented in this version.
        lossless: greedy output equals the unpatched model's (float rounding aside, tested at near-ties).
        bind: ``bind(model, state, config)`` adds ``generate`` keywords and call hooks to ``state``.
        plain: ``plain(copy)`` turns a deep copy of a model patched with this feature into a model that runs
            without hf_accel (in place; the copy has no patch state). ``None``: the copy needs nothing.
    """

    apply: Applier | None
    lossless: bool
    bind: Callable[[nn.Module, PatchState, Any], None] | None = None
    plain: Callable[[nn.Module], None] | None = None


@dataclass
class PatchState:
    """What a patch changed on one model instance (stored on the instance).

    Args:
        config: the :class:`~hf_accel.AccelConfig` it was patched with.
        model_type: the registry entry used.
        recorder: every change, in order (``unpatch_model`` replays it backwards).
        features: every feature this version provides, enabled or not (for errors naming a switched-off one).
        generate_kwargs / call_hooks: what the features added to ``generate``.
        extras: per-model objects features keep across calls (the kept cache, engine, strategies, last stats).
    """

    config: Any
    model_type: str
    recorder: Recorder
    features: Mapping[str, Feature] = field(default_factory=dict)
    generate_kwargs: dict[str, GenerateKwarg] = field(default_factory=dict)
    call_hooks: list[Callable[[nn.Module, GenerateCall], None]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)


def get_state(model: nn.Module) -> PatchState | None:
    """The patch state of ``model``, or ``None`` when it is not patched."""
    return getattr(model, "__dict__", {}).get(STATE_ATTR)  # anything that is not a module: not patched


def plain_copy(model: nn.Module, share: Iterable[torch.Tensor] = ()) -> nn.Module:
    """A deep copy of ``model`` that runs without hf_accel: each enabled feature's :attr:`Feature.plain` undoes its
    instance-level changes on the copy. The original is not touched; an unpatched model is simply deep-copied.

    What the patch attached to the instance (its state, the bound ``generate``, a compiled ``forward``...) is not
    copied at all, so kept caches, engines and drafts never are. The parameters in ``share`` are not copied either:
    the copy holds the very same ``Parameter`` (or buffer) objects (for weights no feature changes and the copy only
    reads; a ``.to()`` of the copy would convert them in the original too).
    """
    state = get_state(model)
    shared: dict[int, Any] = {id(p): p for p in share}
    if state is None:
        return copy.deepcopy(model, shared)
    names = [name for name in state.recorder.instance_attrs(model) if name in model.__dict__]
    memo: dict[int, Any] = {id(state): None, **shared}
    for name in names:
        memo[id(model.__dict__[name])] = None  # deepcopy returns None for these objects instead of copying them
    clone = copy.deepcopy(model, memo)
    for name in [*names, STATE_ATTR]:
        clone.__dict__.pop(name, None)
    for name in state.config.enabled():
        plain = state.features[name].plain
        if plain is not None:
            plain(clone)
    return clone
