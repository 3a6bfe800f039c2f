"""Block allocation for the paged KV cache: pure Python, no tensors, no Transformers.

A pool of ``num_blocks`` fixed-size blocks, each holding ``block_size`` token slots. Sequences own an
ordered block table; blocks are reference counted so sequences can share them (``fork``), and a shared,
partially filled block is copied before it is appended to (copy-on-write). Full blocks can be published in
a prefix table under a chained key of their tokens, so a later sequence with the same token prefix adopts
them instead of recomputing them. The prefix table holds one reference on every block it publishes; such
blocks are evicted (least recently used first) only when the pool would otherwise be full.

The prefix table itself is :mod:`.prefix` (:class:`~.prefix.PrefixTable`, or :class:`~.prefix.NullPrefixTable` for
a manager without prefix reuse). Running out of blocks is a state, not an error: :meth:`BlockManager.append_slots`
returns ``None`` and changes nothing. Misuse (an unknown sequence, a negative count) raises ``ValueError``/``KeyError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .prefix import NullPrefixTable, PrefixTable

__all__ = ["BlockCopy", "BlockManager", "BlockPool"]


class BlockPool:
    """A free list of block ids with reference counts.

    Args:
        num_blocks: blocks in the pool (``>= 1``).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks with refcount 1, or ``None`` (nothing changed) if fewer are free."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free; it cannot be shared")
        self._refs[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns ``True`` when the block went back to the free list."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is already free (double free)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
            return True
        return False

    def grow(self, num_blocks: int) -> None:
        """Add blocks ``self.num_blocks .. num_blocks - 1`` (free); existing blocks keep their ids and counts."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"a pool of {self.num_blocks} blocks cannot shrink to {num_blocks}")
        added = range(num_blocks - 1, self.num_blocks - 1, -1)
        self._refs.extend([0] * (num_blocks - self.num_blocks))
        self._free[:0] = added  # below the stack's top: blocks freed earlier are handed out first
        self.num_blocks = num_blocks


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first ``num_tokens`` slots of block ``src`` into block ``dst`` (copy-on-write)."""

    src: int
    dst: int
    num_tokens: int


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class BlockManager:
    """Per-sequence block tables over a :class:`BlockPool`, with fork, copy-on-write and a prefix table.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block (``>= 1``).
        prefix_cache: keep a :class:`~.prefix.PrefixTable` (publish / match / evict); ``False``: a
            :class:`~.prefix.NullPrefixTable` (publishing does nothing, nothing ever matches).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self.prefix: PrefixTable | NullPrefixTable = (
            PrefixTable(block_size, self.pool.incref, self.pool.decref, self.pool.refcount)
            if prefix_cache
            else NullPrefixTable()
        )
        #: bumped whenever a sequence's block table changes (tensor copies of tables are rebuilt only then)
        self.versions: dict[int, int] = {}

    @property
    def prefix_cache(self) -> bool:
        return self.prefix.enabled

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def grow(self, num_blocks: int) -> None:
        """Extend the pool to ``num_blocks`` blocks (the new ones free; tables and the prefix table unchanged)."""
        self.pool.grow(num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks on the free list (cached prefix blocks not included)."""
        return self.pool.num_free

    @property
    def num_evictable(self) -> int:
        """Cached prefix blocks that only the prefix table still references (an O(1) counter)."""
        return self.prefix.num_evictable

    @property
    def num_cached(self) -> int:
        return self.prefix.num_cached

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def block_table(self, seq: int) -> list[int]:
        return list(self._get(seq).blocks)

    def num_tokens(self, seq: int) -> int:
        return self._get(seq).num_tokens

    def num_shared(self) -> int:
        """Blocks referenced by more than one sequence (the prefix table's own reference not counted)."""
        return sum(1 for b in range(self.num_blocks) if self._seq_refs(b) > 1)

    def _seq_refs(self, block: int) -> int:
        return self.pool.refcount(block) - (1 if self.prefix.holds(block) else 0)

    def _get(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            raise KeyError(f"unknown sequence {seq}") from None

    def _incref(self, block: int) -> None:
        before = self.pool.refcount(block)
        self.pool.incref(block)
        self.prefix.ref_changed(block, before, before + 1)

    def _decref(self, block: int) -> None:
        before = self.pool.refcount(block)
        self.pool.decref(block)
        self.prefix.ref_changed(block, before, before - 1)

    def _changed(self, seq: int) -> None:
        self.versions[seq] = self.versions.get(seq, 0) + 1

    # --------------------------------------------------------------------------------------- lifecycle
    def new_sequence(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = _Seq()
        self.versions[seq] = 0
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq`` (no data copied)."""
        parent = self._get(seq)
        for b in parent.blocks:
            self._incref(b)
        child = self.new_sequence()
        self._seqs[child] = _Seq(list(parent.blocks), parent.num_tokens)
        return child

    def free(self, seq: int) -> None:
        """Release every block of ``seq``; blocks still shared or cached stay allocated."""
        for b in self._get(seq).blocks:
            self._decref(b)
        del self._seqs[seq]
        del self.versions[seq]

    def truncate(self, seq: int, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq`` (speculative rollback); frees emptied blocks."""
        s = self._get(seq)
        if not 0 <= num_tokens <= s.num_tokens:
            raise ValueError(f"cannot truncate sequence {seq} of {s.num_tokens} tokens to {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        if keep < len(s.blocks):
            for b in s.blocks[keep:]:
                self._decref(b)
            del s.blocks[keep:]
            self._changed(seq)
        s.num_tokens = num_tokens

    # -------------------------------------------------------------------------------------- appending
    def blocks_needed(self, seq: int, count: int) -> int:
        """Fresh blocks :meth:`append_slots` would take to add ``count`` tokens to ``seq``."""
        s = self._get(seq)
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count == 0:
            return 0
        used = s.num_tokens % self.block_size
        total = -(-(s.num_tokens + count) // self.block_size) - len(s.blocks)
        cow = 1 if used and not self._writable(s.blocks[-1]) else 0
        return total + cow

    def _writable(self, block: int) -> bool:
        return self.pool.refcount(block) == 1 and not self.prefix.holds(block)

    def append_slots(self, seq: int, count: int) -> tuple[list[int], list[BlockCopy]] | None:
        """Reserve slots for ``count`` new tokens of ``seq``.

        Returns:
            ``(slots, copies)``: the flat slot index (``block * block_size + offset``) of each new token, and the
            copy-on-write copies the caller must perform before writing; or ``None`` when the pool lacks blocks,
            in which case nothing changed.
        """
        needed = self.blocks_needed(seq, count)
        if not self._reclaim(needed):
            return None
        s = self._get(seq)
        copies: list[BlockCopy] = []
        used = s.num_tokens % self.block_size
        if count and used and not self._writable(s.blocks[-1]):
            (fresh,) = self.pool.allocate(1)  # type: ignore[misc]  # reclaim guaranteed it
            copies.append(BlockCopy(s.blocks[-1], fresh, used))
            self._decref(s.blocks[-1])
            s.blocks[-1] = fresh
        grow = needed - len(copies)
        s.blocks.extend(self.pool.allocate(grow) or [])
        if needed:
            self._changed(seq)
        start = s.num_tokens
        slots = [
            s.blocks[t // self.block_size] * self.block_size + t % self.block_size for t in range(start, start + count)
        ]
        s.num_tokens += count
        return slots, copies

    def _reclaim(self, needed: int) -> bool:
        """Make ``needed`` blocks free, evicting least recently used cached prefix blocks if that suffices."""
        if needed <= self.pool.num_free:
            return True
        if needed > self.pool.num_free + self.num_evictable:
            return False
        self.prefix.evict(needed - self.pool.num_free)
        return True

    # ---------------------------------------------------------------------------------- prefix sharing
    def publish(self, seq: int, tokens: Sequence[int]) -> int:
        """Publish the full blocks of ``seq`` in the prefix table; ``tokens`` are its first tokens.

        Returns:
            The number of blocks newly published (0 without a prefix table).
        """
        s = self._get(seq)
        if len(tokens) > s.num_tokens:
            raise ValueError(f"sequence {seq} holds {s.num_tokens} tokens; got {len(tokens)} to publish")
        return self.prefix.publish(s.blocks, tokens)

    def match_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest published prefix of ``tokens`` (full blocks only)."""
        return self.prefix.match(tokens)

    def adopt(self, blocks: Sequence[int], num_tokens: int) -> int:
        """A new sequence whose first ``num_tokens`` tokens are the contents of ``blocks`` (shared)."""
        if not 0 <= num_tokens <= len(blocks) * self.block_size:
            raise ValueError(f"{len(blocks)} blocks cannot hold {num_tokens} tokens")
        keep = list(blocks[: -(-num_tokens // self.block_size)])
        for b in keep:
            self._incref(b)
        seq = self.new_sequence()
        self._seqs[seq] = _Seq(keep, num_tokens)
        return seq

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix block not used by a live sequence, and forget all published keys."""
        self.prefix.clear()

    # ---------------------------------------------------------------------------------------- checking
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if reference counts disagree with the tables (tests and debugging)."""
        expected = [0] * self.num_blocks
        for s in self._seqs.values():
            for b in s.blocks:
                expected[b] += 1
            if len(s.blocks) != -(-s.num_tokens // self.block_size):
                raise AssertionError(f"sequence with {s.num_tokens} tokens has {len(s.blocks)} blocks")
        published = self.prefix.blocks()
        for b in published:
            expected[b] += 1
        actual = [self.pool.refcount(b) for b in range(self.num_blocks)]
        if expected != actual:
            raise AssertionError(f"refcounts {actual} != owners {expected}")
        free = set(self.pool._free)
        if len(free) != len(self.pool._free) or free != {b for b in range(self.num_blocks) if expected[b] == 0}:
            raise AssertionError("free list disagrees with reference counts")
        evictable = sum(1 for b in published if actual[b] == 1)
        if evictable != self.num_evictable:
            raise AssertionError(f"evictable counter {self.num_evictable} != {evictable} cached-only blocks")
