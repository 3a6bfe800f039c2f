"""One ``generate`` call on a patched model, as the features see it, and small helpers every layer shares.

:class:`GenerateCall` is what the ``generate`` wrapper (:mod:`hf_accel.generate`) hands each feature: the
arguments on their way to Transformers, which a feature may rewrite, and wrappers around their execution.
:class:`GenerateKwarg` is one plugin keyword a feature adds to ``generate``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["GenerateCall", "GenerateKwarg", "device_of", "eos_token_ids"]


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
        """Call ``original`` with the (rewritten) arguments inside every wrapper of :attr:`around`."""

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


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def eos_token_ids(eos: Any) -> list[int]:
    """A generation config's ``eos_token_id`` (``None``, an int or a list) as a list of ints."""
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
