"""``PagedCache``: a Transformers ``Cache`` whose K/V live in a preallocated block pool per layer.

The adapter between Transformers' cache contract and the pure parts: block allocation (:mod:`.blocks`,
:mod:`.prefix`), per-forward planning (:mod:`.plan`), pool sizing (:mod:`.pool`). Each layer owns a K and a V pool
``[num_blocks, block_size, kv_heads, head_dim]`` on its device (:mod:`.layer`); the block tables are shared by all
layers. Each batch row is one sequence of *real* tokens (left padding is never stored); the logical length
Transformers sees is the padded one. ``update`` copies nothing: it tags the new K/V for the paged attention function
(:mod:`.attention`), which writes the chunk's real tokens into the pool and attends through the block tables.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..core.config import PagedConfig, parse_bytes
from ..core.errors import CacheFullError, IncompatibleOptionsError, UnsupportedModelError
from ..core.fingerprint import weights_fingerprint
from ..core.lease import exclusive
from ..core.protocols import RowRollback
from ..core.registry import supported_model_types
from .attention import attention_choice, step_attention
from .blocks import BlockCopy, BlockManager
from .export import dense_kv
from .layer import PagedLayer
from .plan import BlockTables, StepPlan, plan_chunk, plan_packed, real_tokens, start_rows, truncate_rows
from .pool import pool_spec
from .stats import cache_stats

__all__ = ["PagedCache"]

T = TypeVar("T")


class PagedCache(Cache, RowRollback):
    """A paged KV cache for ``model.generate`` (on a model patched by :func:`hf_accel.patch_model`).

    Args:
        model: the causal LM this cache is for; K/V shapes, dtype and per-layer devices are taken from it.
        num_blocks: blocks in the pool, reserved now and never more; ``None``: the pool starts small and grows
            on demand up to ``max_memory`` (each ``generate`` call reserves what it can need: its rows x (prompt +
            ``max_new_tokens``), rounded up to blocks; a forward that needs more grows it by at least a quarter).
        block_size: tokens per block.
        max_memory: the most bytes all layers' pools may grow to together: an int or a string such as ``"1GiB"``;
            ``None``: half the free GPU memory, or on CPU a quarter of the available RAM capped at 4 GiB.
            ``stats()["sizing"]`` and the repr say what is reserved and why.
        prefix_cache: publish full blocks of finished prompts/sequences and reuse them for later prompts that
            start with the same tokens (across ``generate`` calls that pass this cache).
        attention: ``"auto"`` (native kernel on CPU when available, the Triton kernel on CUDA, the batched portable
            implementation on other accelerators or without Triton, else gather), ``"kernel"``, ``"batched"`` or
            ``"gather"`` for the decode path (prefill attends densely: per row, or on an accelerator path one call
            for a batch of fresh prompts).

    Raises:
        IncompatibleOptionsError: a bad size, or a pool too small for a single block.

    Example: ``cache = hf_accel.PagedCache(model, max_memory=512 << 20)``, then
    ``model.generate(input_ids, attention_mask=mask, cache=cache)`` and ``cache.stats()["utilisation"]``.
    """

    ATTENTION_MODES = PagedConfig.ATTENTION_MODES

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_memory: int | None = None,
        prefix_cache: bool = True,
        attention: str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise UnsupportedModelError(
                type(model).__name__,
                supported_model_types(),
                reason=f"PagedCache needs a Transformers causal LM (a PreTrainedModel), got {type(model).__name__}",
            )
        if not isinstance(prefix_cache, bool):
            raise IncompatibleOptionsError(f"PagedCache.prefix_cache must be a bool, got {prefix_cache!r}")
        max_memory = parse_bytes(max_memory, "PagedCache.max_memory")
        if attention not in self.ATTENTION_MODES:
            raise IncompatibleOptionsError(
                f"PagedCache.attention must be one of {', '.join(map(repr, self.ATTENTION_MODES))}, got {attention!r}"
            )
        spec = pool_spec(model, block_size, num_blocks, max_memory)
        self.config = model.config
        self.model_type = getattr(model.config, "model_type", type(model).__name__)
        self._model = weakref.ref(model)
        self.block_size, self.block_bytes = block_size, spec.block_bytes
        self.dtype, self.kv_heads, self.head_dim = spec.dtype, spec.kv_heads, spec.head_dim
        self.attention = attention
        self.limit_blocks, self.grows = spec.num_blocks, num_blocks is None  # the most blocks it may hold
        first = 1 if self.grows else spec.num_blocks
        self.sizing = f"{first} blocks reserved ({spec.why})" + (
            f"; grows on demand up to {spec.num_blocks} blocks" if self.grows else ""
        )
        self._limit_why = spec.why
        self.manager = BlockManager(first, block_size, prefix_cache=bool(prefix_cache))
        self.tables = BlockTables(self.manager)
        shape = (first, block_size, spec.kv_heads, spec.head_dim)
        super().__init__(layers=[PagedLayer(self, i, shape, spec.dtype, d) for i, d in enumerate(spec.devices)])
        for layer in self.layers:  # how decode-sized chunks attend (one choice per device, reported)
            layer.attention = attention_choice(attention, layer.device, spec.dtype, block_size, spec.head_dim)
            if step_attention(layer.attention) == "flex":
                layer.zero_fill()
        self._rows: list[int | None] = []  # per batch row: sequence id, or None once released
        self._length = 0  # logical (padded) length, what Transformers sees
        self._step: StepPlan | None = None
        self._pinned: StepPlan | None = None
        self.prefix_hit_tokens = self.prompt_tokens = self.peak_blocks_used = self.prefix_drops = 0
        self._weights = weights_fingerprint(model) if self.prefix_cache else None  # what the K/V are computed with

    @classmethod
    def from_config(cls, model: nn.Module, config: Any) -> PagedCache:
        """A cache sized and configured by a :class:`~hf_accel.PagedConfig`."""
        return cls(
            model, config.num_blocks, config.block_size, config.max_memory, config.prefix_cache, config.attention
        )

    # ------------------------------------------------------------------------------------ reporting
    @property
    def prefix_cache(self) -> bool:
        return self.manager.prefix_cache

    @property
    def num_blocks(self) -> int:  # blocks reserved now (a growing pool: at most limit_blocks)
        return self.manager.num_blocks

    @property
    def max_tokens(self) -> int:  # tokens the pool holds (all sequences together)
        return self.num_blocks * self.block_size

    @property
    def pinned_plan(self) -> StepPlan | None:  # the Engine's packed plan of the next forward (pin_packed), or None
        return self._pinned

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Hold the cache for one ``generate`` call (a cache holds one batch: a second call meanwhile is refused).

        Raises:
            IncompatibleOptionsError: another call (another thread) is using this cache now.
        """
        return exclusive(
            [self],
            lambda: (
                "this PagedCache is serving another generate call (another thread); a cache holds one batch at a "
                "time: build one per thread, or pass paged=True (each call then gets its own)"
            ),
        )

    def belongs_to(self, model: nn.Module) -> bool:
        """Whether this cache was built for ``model`` (a weak reference: never confused with a later object)."""
        return self._model() is model

    def row_sequences(self) -> list[int | None]:  # each batch row's sequence id (None: released)
        return list(self._rows)

    def __repr__(self) -> str:
        reserved = self.num_blocks * self.block_bytes
        return (
            f"PagedCache(model_type={self.model_type!r}, layers={len(self.layers)}, blocks={self.num_blocks}, "
            f"block_size={self.block_size}, tokens={self.max_tokens}, reserved={reserved / 2**20:.1f} MiB, "
            f"dtype={str(self.dtype).removeprefix('torch.')}, rows={len(self._rows)}, seq_length={self._length}, "
            f"sizing={self.sizing!r})"
        )

    def stats(self) -> dict[str, float | int | str]:
        """Block and memory accounting (:func:`~.stats.cache_stats` says what each entry means)."""
        return cache_stats(self)

    def _note_peak(self) -> None:
        m = self.manager
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - m.num_free - m.num_evictable)

    # --------------------------------------------------------------------------- sizing
    def reserve(self, row_tokens: Sequence[int], why: str) -> None:
        """Make the pool hold ``row_tokens[i]`` tokens for each row of the coming batch (rounded up to blocks),
        growing a pool built without ``num_blocks`` up to ``limit_blocks``; ``why`` says for what (``sizing``).
        Call between forwards (``generate`` calls it before each call; the Engine for its whole budget)."""
        need = min(sum(-(-t // self.block_size) for t in row_tokens), self.limit_blocks)
        if self.grows and need > self.num_blocks:
            self._grow(need, f"{need} blocks reserved for {why}")

    def _grow(self, num_blocks: int, why: str) -> None:
        for layer in self.layers:  # [NB, BS, H_kv, D] -> [num_blocks, ...]: stored blocks keep their ids
            layer.grow(num_blocks)
        self.manager.grow(num_blocks)
        self.sizing = f"{why}; may grow up to {self.limit_blocks} blocks ({self._limit_why})"

    def _growing(self, plan: Callable[[], T]) -> T:
        """``plan()``; when the pool is full and may grow, grow it (by at least a quarter) and plan again."""
        try:
            return plan()
        except CacheFullError as err:
            target = self.num_blocks + err.needed - err.free
            if not self.grows:
                raise
            if target > self.limit_blocks:
                room = err.free + self.limit_blocks - self.num_blocks
                detail = f"at its limit of {self.limit_blocks} blocks: {self._limit_why}"
                raise CacheFullError(err.needed, room, detail) from err
            target = max(target, min(self.limit_blocks, self.num_blocks + self.num_blocks // 4))
            self._grow(target, f"grown to {target} blocks when a forward needed {err.needed} more")
            return plan()

    # --------------------------------------------------------------------------- Cache contract
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Tag this layer's new K/V for the paged attention function (:meth:`~.layer.PagedLayer.update`)."""
        return self.layers[layer_idx].update(key_states, value_states)

    def reset(self) -> None:
        """Drop every row (their blocks return to the pool); published prefix blocks stay cached."""
        for seq in self._rows:
            if seq is not None:
                self.manager.free(seq)
        self._rows, self._length, self._step = [], 0, None
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every row (speculative rollback); frees blocks."""
        if tokens_to_remove > 0:
            raise IncompatibleOptionsError(
                f"PagedCache.crop takes a negative count of tokens to remove from the end, got {tokens_to_remove}"
            )
        self.rollback_rows([-tokens_to_remove] * len(self._rows), -tokens_to_remove)

    def rollback_rows(self, drop: Sequence[int], logical: int) -> None:
        """Per-row rollback (speculative decoding with rows that accepted different numbers of drafts).

        Args:
            drop: real tokens to remove from the end of each row (rows released already are skipped).
            logical: tokens to remove from the logical, padded length Transformers sees.

        Raises:
            IncompatibleOptionsError: counts for another number of rows, or more tokens than a row / the cache holds.
        """
        if not 0 <= logical <= self._length:
            raise IncompatibleOptionsError(f"cannot remove {logical} tokens from a cache of {self._length}")
        truncate_rows(self.manager, self._rows, drop)
        self._length -= logical
        self._step = None

    def dense(self, layer_idx: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s K/V laid out padded as ``mask`` says (:func:`~.export.dense_kv`)."""
        return dense_kv(self, layer_idx, mask)

    def _remap_rows(self, sources: Sequence[int]) -> None:
        self._check_sources(sources)
        new_rows = [None if self._rows[i] is None else self.manager.fork(self._rows[i]) for i in sources]
        for seq in self._rows:
            if seq is not None:
                self.manager.free(seq)
        self._rows, self._step = new_rows, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``j`` becomes a fork of old row ``beam_idx[j]`` (block tables are shared, not copied)."""
        self._remap_rows([int(i) for i in beam_idx.tolist()])

    def _check_sources(self, sources: Sequence[int]) -> None:
        bad = [i for i in sources if not 0 <= i < len(self._rows)]
        if bad:
            raise IncompatibleOptionsError(f"row index {bad[0]} is out of range for a cache of {len(self._rows)} rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap_rows([i for i in range(len(self._rows)) for _ in range(repeats)])

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Begin a new batch of ``[B, L]`` left-padded prompts (``attention_mask``: 1 = token, 0 = left padding, or
        ``None``): drop the previous rows and adopt cached prefixes. Returns the logical length already cached (0
        without a prefix hit), where ``generate`` continues from.

        Raises:
            IncompatibleOptionsError: right padding or holes in ``attention_mask``.
            CacheFullError: the prompts alone need more blocks than the pool has.
        """
        self.reset()
        self.check_weights()
        self.peak_blocks_used = 0  # per call: the high-water mark of this batch
        rows = self._growing(lambda: start_rows(self.manager, input_ids, attention_mask))
        self._rows, self._length = rows.seqs, rows.start
        self.prefix_hit_tokens += rows.hit_tokens
        self.prompt_tokens += rows.prompt_tokens
        return rows.start

    def publish(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Publish the full blocks of each live row (its real tokens from ``sequences``) in the prefix table."""
        for row, toks in enumerate(real_tokens(sequences, attention_mask)):
            self.publish_row(row, toks)

    def publish_row(self, row: int, tokens: Sequence[int]) -> None:
        """Publish row ``row``'s full blocks; ``tokens``: its real tokens (those beyond what it holds are ignored)."""
        seq = self._rows[row] if row < len(self._rows) else None
        if seq is not None:
            self.manager.publish(seq, list(tokens)[: self.manager.num_tokens(seq)])

    def release(self, row: int, tokens: Sequence[int] | None = None) -> None:
        """Row ``row`` finished: publish its blocks (given its ``tokens``) and free them."""
        if self._rows[row] is None:
            return
        if tokens is not None:
            self.publish_row(row, tokens)
        self.manager.free(self._rows[row])
        self._rows[row], self._step = None, None

    def released(self, row: int) -> bool:
        return self._rows[row] is None

    def clear_prefix_cache(self) -> None:
        self.manager.clear_prefix_cache()

    def check_weights(self) -> bool:
        """Drop the prefix table if the model's weights changed since its blocks were computed
        (:func:`~hf_accel.core.fingerprint.weights_fingerprint`); :meth:`start` and the Engine's admissions call it.
        Returns whether it was dropped (counted in ``stats()["prefix_drops"]``)."""
        model = self._model()
        if model is None or not self.prefix_cache:
            return False
        now = weights_fingerprint(model)
        if now == self._weights:
            return False
        self._weights = now
        self.manager.clear_prefix_cache()
        self.prefix_drops += 1
        return True

    # --------------------------------------------------------------------------- per forward
    def step_for(self, layer_idx: int, batch: int, q_len: int, padding: torch.Tensor | None) -> StepPlan:
        """The current forward's write plan for layer ``layer_idx`` (``batch`` rows of ``q_len`` tokens; ``padding``
        ``[B, Q]`` True where a token is real, ``None``: all real); a new one starts when layer indices stop
        increasing."""
        if self._pinned is not None:
            return self._pinned
        step = self._step
        if step is None or layer_idx <= step.last_layer or step.q_len != q_len:
            step = self._step = self._plan(batch, q_len, padding)
        step.last_layer = layer_idx
        return step

    def _plan(self, batch: int, q_len: int, padding: torch.Tensor | None) -> StepPlan:
        if not self._rows and self._length == 0:  # a forward without start(), e.g. a plain model(...) call
            self._rows = [self.manager.new_sequence() for _ in range(batch)]
        if batch != len(self._rows):
            raise IncompatibleOptionsError(
                f"PagedCache holds {len(self._rows)} rows but the model got a batch of {batch}; "
                "call cache.start(...) for a new batch (a PagedCache serves one batch at a time)"
            )
        step = self._growing(lambda: plan_chunk(self.manager, self.tables, self._rows, q_len, padding))
        self._note_peak()
        self._length += q_len
        return step

    def decode_plan(
        self, batch: int, padding: torch.Tensor | None, q_len: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plan a short chunk for a forward that writes the pools itself (the compiled decode step): slots allocated as
        the eager path does at its first layer, copy-on-write copies done. Returns ``slots`` ``[B*Q]`` int64 (-1: not
        stored), ``block_tables`` ``[B, MB]`` int32 and ``q_pos`` ``[B, Q]`` int32 (-1: attends to nothing), on the
        first layer's device. Raises ``CacheFullError`` / ``IncompatibleOptionsError`` as any forward does."""
        step = self._plan(batch, q_len, padding)
        self._step = None  # the plan is this step's only; an eager forward after it plans its own
        for layer in self.layers:
            layer.copy_blocks(step.copies)
        device = self.layers[0].device
        return step.padded_slots().to(device), step.block_tables.to(device), step.q_pos.to(device)

    def rows_plan(
        self, seqs: Sequence[int], positions: Sequence[int], slots: Sequence[int], copies: list[BlockCopy]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plan one token for each of ``seqs`` at ``positions`` into ``slots`` (reserved by the caller,
        :class:`hf_accel.Engine`) for a forward that writes the pools itself (the compiled decode step): the
        copy-on-write copies are done here. Returns ``slots`` ``[B]`` int64, ``block_tables`` ``[B, MB]`` int32 and
        ``q_pos`` ``[B, 1]`` int32, on the first layer's device.

        Raises:
            IncompatibleOptionsError: not one slot and one position per sequence.
        """
        if not len(seqs) == len(positions) == len(slots):
            raise IncompatibleOptionsError(
                f"rows_plan needs one position and one slot per sequence, got {len(seqs)} / {len(positions)} / "
                f"{len(slots)}"
            )
        for layer in self.layers:
            layer.copy_blocks(copies)
        self._note_peak()
        device = self.layers[0].device
        q_pos = torch.tensor(list(positions), dtype=torch.int32)[:, None]  # [B, 1]
        slot_t = torch.tensor(list(slots), dtype=torch.int64)
        return slot_t.to(device), self.tables.of(seqs).to(device), q_pos.to(device)

    def pin_packed(
        self, seqs: Sequence[int], starts: Sequence[int], slots: Sequence[int], copies: list[BlockCopy], short_max: int
    ) -> None:
        """Plan the next forward as a packed chunk (:func:`~.plan.plan_packed`; the slots are reserved by the
        caller, :class:`hf_accel.Engine`). Every layer of the next forward uses it; :meth:`unpin` ends it."""
        self._pinned = plan_packed(self.manager, self.tables, seqs, starts, slots, copies, short_max)
        self._rows = list(seqs)
        self._note_peak()

    def unpin(self) -> None:
        """End a packed plan (rows are the engine's, not the cache's: nothing is freed)."""
        self._pinned, self._rows, self._step = None, [], None
