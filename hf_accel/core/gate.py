"""A shared/exclusive gate: many holders at once, or one alone.

A patched model's compiled step uses it to keep ``torch.compile`` away from the model's other calls. While one thread
compiles, ``torch.compiler.is_compiling()`` is true in *every* thread (a process-wide flag), so eager code running
beside a compilation takes its compile-time branches: Transformers' attention modules then route through the
``kernels`` package's compile-aware context variable, which a concurrent eager call corrupts for the rest of the
process. A call that may compile holds the gate alone; the model's other forward calls share it, and so do the
forward calls of the draft models that speculate for it (:func:`model_gate`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch import nn

from .state import get_state

__all__ = ["GATE_KEY", "SharedExclusiveGate", "model_gate"]

#: The key of a patched model's gate in its :attr:`~hf_accel.core.state.PatchState.extras` (set by the compile
#: feature when it binds a compiled paged step).
GATE_KEY = "call_gate"


class SharedExclusiveGate:
    """Shared holders run together; an exclusive holder runs alone. A waiting exclusive holder goes before shared
    holders that arrive after it (no starvation). Not re-entrant: a thread must not ask for it while holding it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    def __deepcopy__(self, memo: dict[int, object]) -> SharedExclusiveGate:
        return SharedExclusiveGate()  # a copy's calls are its own

    def __getstate__(self) -> dict[str, object]:
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def model_gate(model: nn.Module) -> SharedExclusiveGate | None:
    """The gate of a patched model whose calls may compile (its compiled paged step), or ``None``. Code that runs
    another model's forward on this model's behalf (a draft model) shares it, so that the draft's eager attention
    never runs while this model compiles."""
    state = get_state(model)
    gate = None if state is None else state.extras.get(GATE_KEY)
    return gate if isinstance(gate, SharedExclusiveGate) else None
