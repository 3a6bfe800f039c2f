"""Capabilities a cache may have beyond Transformers' ``Cache`` contract, as explicit types (never ``hasattr``)."""

from __future__ import annotations

import abc
from collections.abc import Sequence

__all__ = ["RowRollback"]


class RowRollback(abc.ABC):
    """A cache whose rows can each drop a different number of their newest tokens (speculative decoding with rows
    that accepted different numbers of drafts). Caches without it roll back by cropping every row alike.

    hf_accel's :class:`~hf_accel.PagedCache` is one; after a call on it the rows are the cache's to reset.
    """

    @abc.abstractmethod
    def rollback_rows(self, drop: Sequence[int], logical: int) -> None:
        """Remove ``drop[i]`` real tokens from the end of row ``i`` and ``logical`` from the logical length."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every row."""
