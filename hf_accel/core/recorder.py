"""A journal of every change a patch makes to one model instance, so that it can be undone exactly.

Features never mutate a model directly; they call :class:`Recorder` methods, which apply the change and
remember how to reverse it. :meth:`Recorder.undo` reverses everything in the opposite order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

from .errors import IncompatibleOptionsError

__all__ = ["Recorder"]

_MISSING = object()


@dataclass
class _Change:
    feature: str
    what: str
    undo: Callable[[], None]


def _layout(module: nn.Module) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of a module's first floating-point parameter or buffer (``None``: it has none)."""
    tensors = [*module.parameters(), *module.buffers()]
    first = next((t for t in tensors if t.is_floating_point()), None)
    return None if first is None else (first.dtype, first.device)


class Recorder:
    """Applies changes to a model instance and records how to reverse them."""

    def __init__(self) -> None:
        self._changes: list[_Change] = []
        self._attrs: list[tuple[Any, str]] = []  # (object, name) of every instance attribute set
        #: implementation choices: ``{feature: {what: {"uses": ..., "why": ..., "not": {alternative: why not}}}}``
        self.choices: dict[str, dict[str, dict[str, Any]]] = {}

    def __len__(self) -> int:
        return len(self._changes)

    def counts(self) -> dict[str, dict[str, int]]:
        """``{feature: {kind of change: count}}``."""
        out: dict[str, dict[str, int]] = {}
        for change in self._changes:
            per = out.setdefault(change.feature, {})
            per[change.what] = per.get(change.what, 0) + 1
        return out

    def set_submodule(self, feature: str, parent: nn.Module, name: str, new: nn.Module, what: str) -> None:
        """Replace ``parent.<name>`` (a registered submodule) by ``new``. Undo puts the original back where ``new``
        went meanwhile: moved or cast with the model (``model.to(...)``), it follows."""
        old = parent._modules[name]
        parent._modules[name] = new
        before = _layout(new)

        def undo() -> None:
            now = _layout(parent._modules[name])
            if before is not None and now is not None and now != before:
                old.to(device=now[1], dtype=now[0])
            parent._modules[name] = old

        self._changes.append(_Change(feature, what, undo))

    def set_instance_attr(self, feature: str, obj: Any, name: str, value: Any, what: str) -> None:
        """Set a plain (non-module, non-parameter) attribute in ``obj.__dict__``, e.g. a bound method."""
        old = obj.__dict__.get(name, _MISSING)
        obj.__dict__[name] = value
        self._attrs.append((obj, name))

        def undo() -> None:
            self._attrs = [(o, n) for o, n in self._attrs if not (o is obj and n == name)]
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = old

        self._changes.append(_Change(feature, what, undo))

    def refuse_method(self, feature: str, obj: Any, name: str, message: str, what: str) -> None:
        """Bind ``obj.<name>`` to a method that raises :class:`IncompatibleOptionsError` with ``message``: a model API
        a feature cannot honour, whose error says what to do instead (recorded like :meth:`set_instance_attr`)."""

        def refuse(*args: Any, **kwargs: Any) -> NoReturn:
            raise IncompatibleOptionsError(message)

        self.set_instance_attr(feature, obj, name, refuse, what)

    def set_param_data(self, feature: str, param: nn.Parameter, data: torch.Tensor, what: str) -> None:
        """Point an existing parameter at new storage (e.g. a view into a fused tensor).

        The parameter object stays the same; undo gives it back a private copy of the original values.
        """
        if data.shape != param.shape or data.dtype != param.dtype:
            raise ValueError(f"set_param_data: shape/dtype mismatch {tuple(data.shape)} vs {tuple(param.shape)}")
        param.data = data

        def undo() -> None:
            param.data = param.data.clone()

        self._changes.append(_Change(feature, what, undo))

    def call(self, feature: str, what: str, apply: Callable[[], None], undo: Callable[[], None]) -> None:
        """Run ``apply`` now and ``undo`` on reversal (for changes the other methods do not cover)."""
        apply()
        self._changes.append(_Change(feature, what, undo))

    def release(self, feature: str, what: str, params: list[nn.Parameter], restore: Callable[[], None]) -> None:
        """Free the storage of ``params`` now (each keeps its object, now an empty tensor of its dtype/device);
        ``restore`` gives them their values back on reversal."""

        def free() -> None:
            for param in params:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

        self.call(feature, what, free, restore)

    def instance_attrs(self, obj: Any) -> list[str]:
        """Names of the attributes :meth:`set_instance_attr` set on ``obj`` (and not undone yet)."""
        return [name for owner, name in self._attrs if owner is obj]

    def choose(self, feature: str, what: str, uses: str, why: str, rejected: dict[str, str] | None = None) -> None:
        """Record which implementation ``feature`` runs for ``what`` and why (and why not each other one), for
        ``patch_report``; changes nothing on the model."""
        self.choices.setdefault(feature, {})[what] = {"uses": uses, "why": why, "not": dict(rejected or {})}

    def note(self, feature: str, what: str) -> None:
        """Record a decision that changed nothing (e.g. a module left as it is), so reports can count it."""
        self._changes.append(_Change(feature, what, lambda: None))

    def undo(self) -> None:
        """Reverse every recorded change, newest first, and forget them."""
        while self._changes:
            self._changes.pop().undo()
        self.choices.clear()
