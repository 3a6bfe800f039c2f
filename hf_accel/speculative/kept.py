"""Strategies a patched model keeps for its ``generate`` keywords, lent to one call at a time, and the guard that
keeps a user's :class:`~.strategies.Strategy` instance from serving two calls at once.

A keyword-made strategy (``prompt_lookup=True``, ``draft_model=``, ``speculative=True``) is kept across calls: its
step-cost fit (what the fallback decides with) would otherwise start from a prior each time, and a self-speculative
draft would be copied and quantized again. Concurrent calls (threads of a web server) each borrow their own from a
:class:`~hf_accel.core.lease.LeasePool`; a self-speculative draft copy is shared by the pool's strategies (it only
runs forwards; each strategy keeps its own cache).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.lease import LeasePool, exclusive
from .strategies import Strategy

__all__ = ["KeptStrategies", "claimed"]


@dataclass
class _Entry:
    key: Any
    draft: weakref.ref[nn.Module] | None
    pool: LeasePool[Strategy] = field(default_factory=LeasePool)
    first: Strategy | None = None  # the first strategy made (a later one adopts its self-speculative draft)


class KeptStrategies:
    """One pool of keyword-made strategies per kind (``"prompt_lookup"``, ``"draft"``, ``"self"``); other options
    for a kind replace its pool (strategies lent out then are dropped when given back)."""

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def lend(
        self, kind: str, key: Any, draft: nn.Module | None, make: Callable[[], Strategy]
    ) -> tuple[Strategy, Callable[[], None]]:
        """A strategy for ``(kind, key, draft)`` and the function that gives it back (call it when the call ends)."""
        with self._lock:
            entry = self.entries.get(kind)
            if entry is None or entry.key != key or (entry.draft() if entry.draft else None) is not draft:
                entry = self.entries[kind] = _Entry(key, weakref.ref(draft) if draft is not None else None)
        pool = entry.pool

        def build() -> Strategy:
            strategy = make()
            first = entry.first
            if first is None:
                entry.first = strategy
            else:
                adopt = getattr(strategy, "adopt_draft", None)
                if adopt is not None:
                    adopt(first)
            return strategy

        strategy = pool.acquire(build)
        return strategy, lambda: pool.release(strategy)

    def __deepcopy__(self, memo: dict[int, Any]) -> KeptStrategies:
        return KeptStrategies()  # a copied model makes its own

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeptStrategies, ())


def _members(strategy: Strategy) -> list[Strategy]:
    found = [strategy]
    for part in getattr(strategy, "strategies", ()):  # a Composite: its parts serve the call too
        found.extend(_members(part))
    return found


def claimed(strategy: Strategy) -> contextlib.AbstractContextManager[None]:
    """Mark ``strategy`` (and a Composite's parts) as serving this call until the block ends.

    Raises:
        IncompatibleOptionsError: it is serving another ``generate`` call now (a Strategy holds per-call state).
    """
    return exclusive(
        _members(strategy),
        lambda: (
            f"{strategy!r} is serving another generate call: a Strategy instance holds per-call state and serves "
            "one call at a time. Give each thread its own instance, or use the generate keywords "
            "(prompt_lookup=True, draft_model=..., speculative=True), which lend each call its own strategy"
        ),
    )
