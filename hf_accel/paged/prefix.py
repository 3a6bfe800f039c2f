"""Prefix tables of the paged KV cache: pure Python, no tensors, no Transformers.

A prefix table maps a chain of full blocks' tokens to the pool blocks that hold their K/V, so a later sequence
starting with the same tokens adopts them instead of recomputing them. It holds one pool reference on every block
it publishes; a block only the table still references is *evictable* (least recently used first) when the pool
runs short. :class:`PrefixTable` is that table; :class:`NullPrefixTable` is the same interface doing nothing (a cache
without prefix reuse), so callers never branch on whether prefix caching is on.

The owner (:class:`~.blocks.BlockManager`) tells the table whenever a published block's reference count changes
(:meth:`PrefixTable.ref_changed`), which keeps :attr:`PrefixTable.num_evictable` an O(1) counter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["NullPrefixTable", "PrefixKey", "PrefixTable"]

#: A prefix-table key: ``(entry id of the previous block or -1, tokens of this block)``; exact, collision-free.
#: Entry ids are never reused, so a key cannot come to mean another prefix after an eviction.
PrefixKey = tuple[int, tuple[int, ...]]


@dataclass(frozen=True)
class _Entry:
    block: int
    eid: int


class PrefixTable:
    """Published full blocks, by chained token key, least recently used first.

    Args:
        block_size: tokens per block.
        incref / decref: the pool's reference counting (``decref`` returns whether the block became free).
        refcount: the pool's current count of a block.
    """

    enabled = True

    def __init__(
        self,
        block_size: int,
        incref: Callable[[int], None],
        decref: Callable[[int], bool],
        refcount: Callable[[int], int],
    ) -> None:
        self.block_size = block_size
        self._incref, self._decref, self._refcount = incref, decref, refcount
        self._entries: OrderedDict[PrefixKey, _Entry] = OrderedDict()
        self._block_key: dict[int, PrefixKey] = {}
        self._next_eid = 0
        self.num_evictable = 0  # published blocks only the table references (refcount 1)

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    def holds(self, block: int) -> bool:
        """Whether ``block`` is published (the table holds a reference on it)."""
        return block in self._block_key

    def ref_changed(self, block: int, before: int, after: int) -> None:
        """A published-or-not block's reference count went from ``before`` to ``after`` (kept O(1))."""
        if block in self._block_key:
            self.num_evictable += (after == 1) - (before == 1)

    def chunks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        """The full blocks' worth of ``tokens``, as tuples of ints."""
        bs = self.block_size
        return [tuple(int(t) for t in tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]

    def publish(self, blocks: Sequence[int], tokens: Sequence[int]) -> int:
        """Publish ``blocks`` (a sequence's table) as holding ``tokens`` (its first tokens); returns how many blocks
        were newly published."""
        added, parent = 0, -1
        for i, chunk in enumerate(self.chunks(tokens)):
            key = (parent, chunk)
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            else:
                block = blocks[i]
                if block in self._block_key:  # already published under another key: keep the first meaning
                    entry = self._entries[self._block_key[block]]
                else:
                    entry = _Entry(block, self._next_eid)
                    self._next_eid += 1
                    self._entries[key] = entry
                    self._block_key[block] = key
                    self._incref(block)  # the table's own reference (the block is live: never 1 after this)
                    added += 1
            parent = entry.eid
        return added

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest published prefix of ``tokens`` (full blocks only)."""
        blocks: list[int] = []
        parent = -1
        for chunk in self.chunks(tokens):
            entry = self._entries.get((parent, chunk))
            if entry is None:
                break
            self._entries.move_to_end((parent, chunk))
            blocks.append(entry.block)
            parent = entry.eid
        return blocks

    def evict(self, count: int) -> int:
        """Unpublish up to ``count`` evictable blocks, least recently used first (they return to the pool); returns
        how many were freed."""
        freed = 0
        for key in list(self._entries):
            if freed >= count:
                break
            if self._refcount(self._entries[key].block) == 1:
                self._unpublish(key)
                freed += 1
        return freed

    def clear(self) -> None:
        """Forget every published key; blocks no live sequence uses return to the pool."""
        for key in list(self._entries):
            self._unpublish(key)

    def _unpublish(self, key: PrefixKey) -> None:
        entry = self._entries.pop(key)
        if self._refcount(entry.block) == 1:
            self.num_evictable -= 1
        del self._block_key[entry.block]
        self._decref(entry.block)

    def blocks(self) -> list[int]:
        """Every published block (for invariant checks)."""
        return [e.block for e in self._entries.values()]


class NullPrefixTable:
    """The :class:`PrefixTable` interface for a cache without prefix reuse: nothing is published or matched."""

    enabled = False
    num_evictable = 0
    num_cached = 0

    def holds(self, block: int) -> bool:
        return False

    def ref_changed(self, block: int, before: int, after: int) -> None:
        return None

    def publish(self, blocks: Sequence[int], tokens: Sequence[int]) -> int:
        return 0

    def match(self, tokens: Sequence[int]) -> list[int]:
        return []

    def evict(self, count: int) -> int:
        return 0

    def clear(self) -> None:
        return None

    def blocks(self) -> list[int]:
        return []
