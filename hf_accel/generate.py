"""The per-instance ``generate`` wrapper of a patched model.

It takes hf_accel's own keyword arguments out of the call, lets the feature that owns each one translate it
into Transformers' terms (a ``cache=``, a ``custom_generate=`` callable, ...), and passes everything else to
the model's original ``generate`` untouched, so a misspelt argument still gets Transformers' own error.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from .errors import FeatureNotAvailableError, IncompatibleOptionsError

if TYPE_CHECKING:
    from .patch import PatchState
    from .recorder import Recorder

__all__ = ["PLUGIN_KWARGS", "GenerateCall", "GenerateKwarg", "bind_generate"]

#: Every ``generate`` keyword hf_accel owns -> the feature that implements it.
PLUGIN_KWARGS: dict[str, str] = {
    "paged": "paged",
    "speculative": "speculative",
    "draft_model": "speculative",
    "num_speculative_tokens": "speculative",
    "prompt_lookup": "speculative",
}


@dataclass
class GenerateCall:
    """One ``generate`` call on its way to Transformers: features may rewrite it and wrap its execution.

    Args:
        args / kwargs: what goes to the original ``generate`` (plugin kwargs already taken out).
        around: wrappers ``wrap(proceed) -> output``; each must call ``proceed()`` once. The first one added
            is the outermost.
        notes: scratch space where a feature's keyword handlers leave values for its call hook.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    around: list[Callable[[Callable[[], Any]], Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def input_ids(self) -> Any:
        """The prompt tensor, wherever the caller put it (first positional, ``input_ids=`` or ``inputs=``)."""
        if self.args:
            return self.args[0]
        return self.kwargs.get("input_ids", self.kwargs.get("inputs"))

    def run(self, original: Callable[..., Any]) -> Any:
        def innermost() -> Any:
            return original(*self.args, **self.kwargs)

        proceed = innermost
        for wrap in reversed(self.around):
            proceed = functools.partial(wrap, proceed)
        return proceed()


@dataclass(frozen=True)
class GenerateKwarg:
    """One plugin keyword argument of ``generate``.

    Args:
        name: the keyword.
        feature: the feature that owns it.
        apply: ``apply(model, value, call)`` rewrites the :class:`GenerateCall` in place.
    """

    name: str
    feature: str
    apply: Callable[[nn.Module, Any, GenerateCall], None]


def _split_plugin_kwargs(state: PatchState, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = set(PLUGIN_KWARGS) | set(state.generate_kwargs)
    return {name: kwargs.pop(name) for name in list(kwargs) if name in names}


def _apply_plugin_kwargs(model: nn.Module, state: PatchState, plugin: dict[str, Any], call: GenerateCall) -> None:
    for name, value in plugin.items():
        handler = state.generate_kwargs.get(name)
        if handler is None:
            feature = PLUGIN_KWARGS[name]
            from .patch import FEATURES

            if FEATURES[feature].apply is not None:  # implemented, but switched off for this model
                raise IncompatibleOptionsError(
                    f"generate({name}=...) needs hf_accel's {feature!r} feature, which is off for this model; "
                    f"patch it with hf_accel.patch_model(model, {feature}=True)"
                )
            raise FeatureNotAvailableError(
                f"generate({name}=...) needs hf_accel's {feature!r} feature, which this version does not provide"
            )
        handler.apply(model, value, call)


def bind_generate(model: nn.Module, state: PatchState, recorder: Recorder) -> None:
    """Bind the wrapper as ``model.generate`` on this instance only (recorded, so unpatch removes it)."""
    original = model.generate  # bound method of the class, or a wrapper someone else bound before us

    @functools.wraps(original)
    def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        plugin = _split_plugin_kwargs(state, kwargs)
        call = GenerateCall(args, kwargs)
        _apply_plugin_kwargs(self, state, plugin, call)
        for hook in state.call_hooks:
            hook(self, call)
        return call.run(original)

    recorder.set_instance_attr("core", model, "generate", types.MethodType(generate, model), "generate wrapped")
