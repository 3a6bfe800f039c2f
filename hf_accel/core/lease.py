"""Objects a patched model keeps across ``generate`` calls (a paged cache, a speculative strategy), each lent to one
call at a time: concurrent calls from several threads each get their own, made on demand and kept for reuse; and
:func:`exclusive`, the guard that keeps an object a user passes in from serving two calls at once."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from .errors import IncompatibleOptionsError

__all__ = ["LeasePool", "exclusive"]

T = TypeVar("T")


class LeasePool(Generic[T]):
    """A pool of interchangeable objects; :meth:`acquire` lends an idle one (or makes a new one), :meth:`release`
    gives it back. Thread-safe; an object is never lent to two holders at once.

    Args:
        keep: idle objects kept at most (the rest are dropped when given back).

    A copy (``copy.deepcopy`` of a patched model, pickling) is an empty pool: what it holds belongs to the original.
    """

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._idle: list[T] = []
        self._lock = threading.Lock()
        self.made = 0  # objects built so far (tests and reports)

    def acquire(self, make: Callable[[], T]) -> T:
        """An idle object, or ``make()`` when every one is lent out."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.made += 1
        return make()

    def release(self, obj: T) -> None:
        """Give ``obj`` back (kept for the next :meth:`acquire` unless ``keep`` are idle already)."""
        with self._lock:
            if len(self._idle) < self._keep and not any(o is obj for o in self._idle):
                self._idle.append(obj)

    def idle(self) -> list[T]:
        """The objects not lent out now (a copy of the list)."""
        with self._lock:
            return list(self._idle)

    def clear(self) -> None:
        """Drop every idle object (lent ones are dropped when given back only if ``keep`` is reached)."""
        with self._lock:
            self._idle.clear()

    def __deepcopy__(self, memo: dict[int, Any]) -> LeasePool[T]:
        return LeasePool(self._keep)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LeasePool, (self._keep,))


_BUSY: set[int] = set()  # ids of the objects serving a call now (alive: the call holds them)
_BUSY_LOCK = threading.Lock()


@contextlib.contextmanager
def exclusive(objects: Sequence[object], busy: Callable[[], str]) -> Iterator[None]:
    """Mark ``objects`` as serving this call until the block ends.

    Raises:
        IncompatibleOptionsError: one of them is serving another call now (message: ``busy()``).
    """
    ids = [id(o) for o in objects]
    with _BUSY_LOCK:
        if any(i in _BUSY for i in ids):
            raise IncompatibleOptionsError(busy())
        _BUSY.update(ids)
    try:
        yield
    finally:
        with _BUSY_LOCK:
            _BUSY.difference_update(ids)
