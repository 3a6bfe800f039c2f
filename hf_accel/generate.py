"""The per-instance ``generate`` wrapper of a patched model.

It takes hf_accel's own keyword arguments out of the call, lets the feature that owns each one translate it
into Transformers' terms (a ``cache=``, a ``custom_generate=`` callable, ...), and passes everything else to
the model's original ``generate`` untouched, so a misspelt argument still gets Transformers' own error.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .errors import FeatureNotAvailableError

if TYPE_CHECKING:
    from .patch import PatchState
    from .recorder import Recorder

__all__ = ["PLUGIN_KWARGS", "GenerateKwarg", "bind_generate"]

#: Every ``generate`` keyword hf_accel owns -> the feature that implements it.
PLUGIN_KWARGS: dict[str, str] = {
    "paged": "paged",
    "speculative": "speculative",
    "draft_model": "speculative",
    "num_speculative_tokens": "speculative",
    "prompt_lookup": "speculative",
}


@dataclass(frozen=True)
class GenerateKwarg:
    """One plugin keyword argument of ``generate``.

    Args:
        name: the keyword.
        feature: the feature that owns it.
        apply: ``apply(model, value, hf_kwargs)`` rewrites the remaining Transformers kwargs in place.
    """

    name: str
    feature: str
    apply: Callable[[nn.Module, Any, dict[str, Any]], None]


def _split_plugin_kwargs(state: PatchState, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = set(PLUGIN_KWARGS) | set(state.generate_kwargs)
    return {name: kwargs.pop(name) for name in list(kwargs) if name in names}


def _apply_plugin_kwargs(model: nn.Module, state: PatchState, plugin: dict[str, Any], kwargs: dict[str, Any]) -> None:
    for name, value in plugin.items():
        handler = state.generate_kwargs.get(name)
        if handler is None:
            feature = PLUGIN_KWARGS[name]
            raise FeatureNotAvailableError(
                f"generate({name}=...) needs hf_accel's {feature!r} feature, which this version does not provide"
            )
        handler.apply(model, value, kwargs)


def bind_generate(model: nn.Module, state: PatchState, recorder: Recorder) -> None:
    """Bind the wrapper as ``model.generate`` on this instance only (recorded, so unpatch removes it)."""
    original = model.generate  # bound method of the class, or a wrapper someone else bound before us

    @functools.wraps(original)
    def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        plugin = _split_plugin_kwargs(state, kwargs)
        _apply_plugin_kwargs(self, state, plugin, kwargs)
        return original(*args, **kwargs)

    recorder.set_instance_attr("core", model, "generate", types.MethodType(generate, model), "generate wrapped")
