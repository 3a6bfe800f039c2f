"""Per-forward planning of the paged KV cache: which pool slots a chunk's tokens are written to, and which blocks
each row attends over. Tensors and the block manager only; no Transformers.

:func:`plan_chunk` plans a ``[B, Q]`` chunk of a batch (one sequence per row; left padding and holes are not stored)
the way every layer of the forward will use it; :func:`plan_packed` plans the Engine's packed chunk (several
sequences' tokens back to back, their slots already reserved by the scheduler). :class:`BlockTables` keeps tensor
copies of the rows' block tables and rebuilds a row only when the manager says its table changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import CacheFullError, IncompatibleOptionsError
from ..kernels.reference import token_slots
from .blocks import BlockCopy, BlockManager

__all__ = [
    "BlockTables",
    "PackedRows",
    "StepPlan",
    "context_slots",
    "plan_chunk",
    "plan_packed",
    "real_tokens",
    "start_rows",
    "truncate_rows",
]


@dataclass(frozen=True)
class PackedRows:
    """How a packed forward (``[1, N]`` tokens of several sequences back to back) maps onto rows.

    Rows feeding few tokens (decode, speculative verification) are attended together through the native kernel,
    padded to the longest of them; the others (prompt chunks) are attended one by one on their own slice.

    Args:
        offsets / lengths: where each row's tokens start in the chunk, and how many there are.
        short: rows of at most ``short_max`` tokens.
        short_index: ``[Rs, Qs]`` int64: position in the chunk of each short row's ``j``-th token (0 for padding).
        short_real: ``[Rs, Qs]`` bool: which entries of ``short_index`` are tokens.
        short_q_pos / short_tables: the kernel's ``q_pos`` (-1 for padding) and block tables of the short rows.
    """

    offsets: list[int]
    lengths: list[int]
    short: list[int]
    short_index: torch.Tensor
    short_real: torch.Tensor
    short_q_pos: torch.Tensor
    short_tables: torch.Tensor
    on_device: dict[Any, dict[str, torch.Tensor]] = field(default_factory=dict, compare=False)

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The short rows' tensors on ``device``, moved once per device: ``index``, ``tables``, ``q_pos``, and
        ``real_flat`` (``[T]`` flat positions of ``[Rs, Qs]`` that are tokens) with ``real_at`` (``[T]`` their
        positions in the chunk), so results are scattered back without a boolean index on the device."""
        if device not in self.on_device:
            moved = _scatter_indices(self.short_index, self.short_real, device)
            moved.update(tables=self.short_tables.to(device), q_pos=self.short_q_pos.to(device))
            self.on_device[device] = moved
        return self.on_device[device]

    def rows_tensors(self, device: torch.device, rows: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Rows ``rows`` (prompt chunks from position 0) padded to the longest, moved once per device and set:
        ``index`` ``[R, W]`` (chunk position of each row's ``j``-th token, 0 for padding), ``q_pos`` ``[R, W]``
        (``j``, -1 for padding), ``real_flat`` / ``real_at`` as in :meth:`tensors`."""
        key = (device, rows)
        cached = self.on_device.get(key)
        if cached is None:
            index, real = _padded_index([self.lengths[r] for r in rows], [self.offsets[r] for r in rows])
            cached = _scatter_indices(index, real, device)
            cached["q_pos"] = torch.where(real, torch.arange(index.shape[1]), -1).to(torch.int32).to(device)
            self.on_device[key] = cached
        return cached


def _padded_index(lengths: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``lengths[i]`` tokens starting at chunk position ``starts[i]``, padded to the longest (at least 1):
    ``index`` ``[R, W]`` int64 (chunk position of each row's ``j``-th token, 0 for padding) and ``real`` ``[R, W]``."""
    arange = torch.arange(max(lengths, default=1))[None, :]  # [1, W]
    real = arange < torch.tensor(lengths, dtype=torch.long).reshape(-1, 1)  # [R, W]
    return torch.where(real, torch.tensor(starts, dtype=torch.long).reshape(-1, 1) + arange, 0), real


def _scatter_indices(index: torch.Tensor, real: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """``index`` on ``device``, with ``real_flat`` (``[T]`` flat positions of ``[R, W]`` that are tokens) and
    ``real_at`` (``[T]`` their chunk positions), computed from the host copies (no device sync)."""
    real_flat = real.flatten().nonzero().flatten()
    return {
        "index": index.to(device),
        "real_flat": real_flat.to(device),
        "real_at": index.flatten()[real_flat].to(device),
    }


def _packed_rows(lengths: list[int], q_pos: torch.Tensor, tables: torch.Tensor, short_max: int) -> PackedRows:
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    short = [i for i, n in enumerate(lengths) if n <= short_max]
    index, real = _padded_index([lengths[i] for i in short], [offsets[i] for i in short])  # [Rs, Qs]
    width = index.shape[1]
    return PackedRows(
        offsets=offsets,
        lengths=lengths,
        short=short,
        short_index=index,
        short_real=real,
        short_q_pos=q_pos[short][:, :width].contiguous(),
        short_tables=tables[short].contiguous(),
    )


@dataclass
class StepPlan:
    """What one forward pass writes: computed at its first layer, reused by every other layer.

    Args:
        q_len: tokens per row in the chunk.
        valid: ``[B, Q]`` bool: real (stored) tokens of this chunk.
        all_valid: every entry of ``valid`` is True.
        slots: ``[N]`` int64: pool slot of each valid token, row-major.
        copies: copy-on-write block copies to perform before writing.
        block_tables: ``[B, MB]`` int32.
        q_pos: ``[B, Q]`` int32: index of each query in its sequence, -1 for padding / released rows.
        fresh: per row, nothing stored before this chunk.
        seqs: per row, its sequence id (``None``: released).
        packed: the Engine's packed layout, or ``None``.
    """

    q_len: int
    valid: torch.Tensor
    all_valid: bool
    slots: torch.Tensor
    copies: list[BlockCopy]
    block_tables: torch.Tensor
    q_pos: torch.Tensor
    fresh: list[bool]
    seqs: list[int | None]
    last_layer: int = -1
    packed: PackedRows | None = None
    ctx_slots: dict[int, torch.Tensor] = field(default_factory=dict)  # per row: its whole context's slots, lazily
    on_device: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)

    def padded_slots(self) -> torch.Tensor:
        """``[B*Q]`` int64: each chunk position's slot, row-major, -1 where the token is not stored."""
        slots = torch.full((self.valid.numel(),), -1, dtype=torch.int64)
        slots[self.valid.flatten()] = self.slots  # row-major, as the rows' slots were allocated
        return slots

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``slots`` / ``block_tables`` / ``q_pos`` on ``device`` (moved once per device), and
        ``valid_index`` (``[N]`` int64 row-major positions of the stored tokens, only when some are not: writes
        select them without a boolean index, which would wait for the device)."""
        if device not in self.on_device:
            moved = {n: getattr(self, n).to(device) for n in ("slots", "block_tables", "q_pos")}
            if not self.all_valid:
                moved["valid_index"] = self.valid.flatten().nonzero().flatten().to(device)  # from the host copy
            self.on_device[device] = moved
        return self.on_device[device]


class BlockTables:
    """``[R, max blocks]`` int32 tensors of sequences' block tables, a row rebuilt only when its table changed.

    Args:
        manager: the block manager whose :attr:`~.blocks.BlockManager.versions` say when a table changed.
    """

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # seq -> (version, [blocks] int32)

    def row(self, seq: int) -> torch.Tensor:
        """``[blocks]`` int32 block table of ``seq``."""
        version = self.manager.versions[seq]
        cached = self._rows.get(seq)
        if cached is None or cached[0] != version:
            cached = (version, torch.tensor(self.manager.block_table(seq), dtype=torch.int32))
            self._rows[seq] = cached
        return cached[1]

    def of(self, seqs: Sequence[int | None]) -> torch.Tensor:
        """``[R, max blocks]`` int32 (zero-padded; a released row, ``None``, is all padding)."""
        live = set(self.manager.versions)
        for gone in [s for s in self._rows if s not in live]:
            del self._rows[gone]
        rows = [self.row(s) if s is not None else None for s in seqs]
        out = torch.zeros(len(rows), max([1] + [r.numel() for r in rows if r is not None]), dtype=torch.int32)
        for i, r in enumerate(rows):
            if r is not None:
                out[i, : r.numel()] = r
        return out


def _reserve(manager: BlockManager, seqs: Sequence[int | None], counts: list[int]) -> tuple[list[int], list[BlockCopy]]:
    """Slots (row-major) and copy-on-write copies for ``counts[i]`` new tokens of each live row.

    Raises:
        CacheFullError: the pool cannot hold them (nothing reserved).
    """
    needed = sum(manager.blocks_needed(s, c) for s, c in zip(seqs, counts, strict=True) if s is not None)
    available = manager.num_free + manager.num_evictable
    if needed > available:
        raise CacheFullError(
            needed,
            available,
            f"this step needs {needed} more blocks of {manager.block_size} tokens for {len(seqs)} rows but "
            f"{available} are free ({manager.num_blocks} total); raise num_blocks/max_memory, or lower the batch "
            "size or max_new_tokens",
        )
    slots: list[int] = []
    copies: list[BlockCopy] = []
    for seq, count in zip(seqs, counts, strict=True):
        if seq is None or count == 0:
            continue
        got = manager.append_slots(seq, count)
        if got is None:  # cannot happen after the check above; keep the state honest if it does
            raise CacheFullError(needed, manager.num_free, "block reclaim failed")
        slots.extend(got[0])
        copies.extend(got[1])
    return slots, copies


def plan_chunk(
    manager: BlockManager, tables: BlockTables, seqs: list[int | None], q_len: int, padding: torch.Tensor | None
) -> StepPlan:
    """Reserve slots for a ``[B, Q]`` chunk of rows ``seqs`` and describe it for every layer.

    Args:
        manager / tables: the cache's block manager and its block-table tensors.
        seqs: each row's sequence id (``None``: released; it stores nothing and attends to nothing).
        q_len: tokens per row.
        padding: ``[B, Q]`` bool, True where the chunk's token is real; ``None`` = all real.

    Raises:
        CacheFullError: the pool cannot hold the chunk's real tokens.
    """
    rows = len(seqs)
    valid = padding.to("cpu", torch.bool) if padding is not None else torch.ones(rows, q_len, dtype=torch.bool)
    alive = torch.tensor([s is not None for s in seqs])
    valid = valid & alive[:, None]  # [B, Q]
    counts = valid.sum(1).tolist()
    before = [manager.num_tokens(s) if s is not None else 0 for s in seqs]
    slots, copies = _reserve(manager, seqs, counts)
    rank = valid.to(torch.int32).cumsum(1) - 1  # index of each real token among the chunk's real tokens
    q_pos = torch.where(valid, rank + torch.tensor(before, dtype=torch.int32)[:, None], -1).to(torch.int32)
    return StepPlan(
        q_len=q_len,
        valid=valid,
        all_valid=bool(valid.all()),
        slots=torch.tensor(slots, dtype=torch.int64),
        copies=copies,
        block_tables=tables.of(seqs),
        q_pos=q_pos,
        fresh=[b == 0 for b in before],
        seqs=list(seqs),
    )


def plan_packed(
    manager: BlockManager,
    tables: BlockTables,
    seqs: Sequence[int],
    starts: Sequence[int],
    slots: Sequence[int],
    copies: list[BlockCopy],
    short_max: int,
) -> StepPlan:
    """The plan of a packed chunk: sequence ``seqs[i]`` feeds its tokens from position ``starts[i]`` on, laid out row
    after row (``[1, N]``, ``N = len(slots)``); the slots were reserved by the caller (the Engine's scheduler).

    Raises:
        ValueError: ``slots`` does not hold one slot per packed token.
    """
    lengths = [manager.num_tokens(s) - b for s, b in zip(seqs, starts, strict=True)]
    if sum(lengths) != len(slots):
        raise IncompatibleOptionsError(f"{len(slots)} slots for {sum(lengths)} packed tokens")
    width = max(lengths)
    arange = torch.arange(width)
    real = arange[None, :] < torch.tensor(lengths)[:, None]  # [R, Qmax]
    q_pos = torch.where(real, torch.tensor(list(starts))[:, None] + arange[None, :], -1).to(torch.int32)
    block_tables = tables.of(seqs)
    return StepPlan(
        q_len=len(slots),
        valid=torch.ones(1, len(slots), dtype=torch.bool),
        all_valid=True,
        slots=torch.tensor(list(slots), dtype=torch.int64),
        copies=copies,
        block_tables=block_tables,
        q_pos=q_pos,
        fresh=[b == 0 for b in starts],
        seqs=list(seqs),
        packed=_packed_rows(lengths, q_pos, block_tables, short_max),
    )


def context_slots(manager: BlockManager, tables: BlockTables, step: StepPlan, row: int) -> torch.Tensor:
    """``[n]`` int64 pool slots of row ``row``'s whole stored context (computed once per plan and row)."""
    cached = step.ctx_slots.get(row)
    if cached is None:
        seq = step.seqs[row]
        n = manager.num_tokens(seq) if seq is not None else 0
        table = tables.row(seq) if seq is not None else torch.zeros(0, dtype=torch.int32)
        cached = step.ctx_slots[row] = token_slots(table, n, manager.block_size)
    return cached


@dataclass(frozen=True)
class StartedRows:
    """A new batch's rows: each row's sequence id, the logical length already cached (the shortest prefix hit,
    padding included), tokens adopted from the prefix table and real prompt tokens."""

    seqs: list[int | None]
    start: int
    hit_tokens: int
    prompt_tokens: int


def start_rows(manager: BlockManager, input_ids: torch.Tensor, mask: torch.Tensor | None) -> StartedRows:
    """One new sequence per prompt row, adopting the longest cached prefix every row shares in logical columns.

    Raises:
        IncompatibleOptionsError: right padding or holes in ``mask``.
        CacheFullError: the prompts alone need more blocks than the pool has.
    """
    real = real_tokens(input_ids, mask)
    pads = [input_ids.shape[1] - len(toks) for toks in real]
    bs = manager.block_size
    need = sum(-(-len(toks) // bs) for toks in real)
    if need > manager.num_blocks:
        raise CacheFullError(
            need,
            manager.num_blocks,
            f"the {len(real)} prompts alone need {need} blocks of {bs} tokens but the pool has "
            f"{manager.num_blocks}; raise num_blocks/max_memory or send fewer/shorter prompts",
        )
    matches = [manager.match_prefix(t[:-1]) for t in real]
    start = min(p + len(m) * bs for p, m in zip(pads, matches, strict=True))
    seqs: list[int | None] = []
    hit = 0
    for pad, blocks in zip(pads, matches, strict=True):
        adopted = max(0, start - pad)
        seqs.append(manager.adopt(blocks, adopted) if adopted else manager.new_sequence())
        hit += adopted
    return StartedRows(seqs, start, hit, sum(len(t) for t in real))


def truncate_rows(manager: BlockManager, seqs: Sequence[int | None], drop: Sequence[int]) -> None:
    """Remove ``drop[i]`` tokens from the end of each live row's sequence; checks every row before changing any.

    Raises:
        ValueError: counts for another number of rows, or more tokens than a row holds.
    """
    if len(drop) != len(seqs):
        raise IncompatibleOptionsError(f"rollback_rows got {len(drop)} counts for {len(seqs)} rows")
    for seq, n in zip(seqs, drop, strict=True):
        have = manager.num_tokens(seq) if seq is not None else 0
        if seq is not None and not 0 <= n <= have:
            raise IncompatibleOptionsError(f"cannot remove {n} tokens from a row that holds {have} real tokens")
    for seq, n in zip(seqs, drop, strict=True):
        if seq is not None and n:
            manager.truncate(seq, manager.num_tokens(seq) - n)


def real_tokens(ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens without its left padding.

    Raises:
        IncompatibleOptionsError: a mask of another shape, right padding or holes.
    """
    if mask is None:
        return ids.tolist()
    mask = mask.to("cpu").bool()
    if mask.shape != ids.shape:
        raise IncompatibleOptionsError(
            f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}"
        )
    out = []
    for row, (toks, m) in enumerate(zip(ids.tolist(), mask.tolist(), strict=True)):
        n = sum(m)
        if any(m[: len(m) - n]) or not all(m[len(m) - n :]):
            raise IncompatibleOptionsError(
                f"PagedCache needs left padding: row {row} of attention_mask has padding after a token; "
                "set tokenizer.padding_side = 'left'"
            )
        out.append(toks[len(toks) - n :])
    return out
