"""The engine's requests by id, and how long a finished request's output is kept.

A finished output stays readable (:meth:`~.engine.Engine.result`, :meth:`~.engine.Engine.stream`) until ``keep``
newer requests have finished; then the oldest is forgotten (a long-running engine does not grow without bound).
A request a caller is waiting for (:meth:`~.engine.Engine.generate_many`) is never forgotten before that caller
has collected it, however many others finish meanwhile. Not thread-safe on its own: the engine holds its lock.
"""

from __future__ import annotations

import collections

from ..core.errors import IncompatibleOptionsError
from .request import Tracked

__all__ = ["Ledger", "UnknownRequestError"]


class UnknownRequestError(IncompatibleOptionsError, KeyError):
    """A request id this engine never returned (or one finished and forgotten: see ``Engine(keep_finished=...)``)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Ledger:
    """Requests by id; finished ones kept up to ``keep`` (oldest forgotten first), awaited ones until collected."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.requests: dict[int, Tracked] = {}
        self._order: collections.deque[int] = collections.deque()  # forgettable finished ids, oldest first
        self._awaited: set[int] = set()

    def add(self, rid: int, tracked: Tracked, awaited: bool = False) -> None:
        """Track a new request; ``awaited``: a caller will collect it (:meth:`collected`), keep it until then."""
        self.requests[rid] = tracked
        if awaited:
            self._awaited.add(rid)

    def get(self, rid: int) -> Tracked:
        """The request ``rid``.

        Raises:
            UnknownRequestError: never returned by ``add_request``, or finished and forgotten.
        """
        try:
            return self.requests[rid]
        except KeyError:
            raise UnknownRequestError(
                f"unknown request id {rid!r} (never returned by add_request, or finished and forgotten after "
                f"{self.keep} newer ones: raise Engine(keep_finished=...))"
            ) from None

    def finished(self, rid: int) -> None:
        """``rid`` finished: it becomes forgettable, unless a caller awaits it."""
        if rid not in self._awaited:
            self._retire(rid)

    def collected(self, rid: int) -> None:
        """The caller awaiting ``rid`` has its output: from now on it is forgettable like any other."""
        if rid in self._awaited:
            self._awaited.discard(rid)
            self._retire(rid)

    def _retire(self, rid: int) -> None:
        self._order.append(rid)
        while len(self._order) > self.keep:
            self.requests.pop(self._order.popleft(), None)
