"""``PagedCache``: a Transformers ``Cache`` whose K/V live in a preallocated block pool per layer.

The adapter between Transformers' cache contract and the pure block manager (:mod:`.blocks`):

* every layer owns one K pool and one V pool, ``[num_blocks, block_size, kv_heads, head_dim]``, on that
  layer's device; the block tables are shared by all layers (one :class:`~.blocks.BlockManager`);
* each batch row is one sequence of *real* tokens: left padding is never stored, so a row's table only
  covers what it attends to; the logical length Transformers sees (``get_seq_length``) is the padded one;
* ``update`` does not copy anything: it tags the new K/V with their layer and hands them to the paged
  attention function (:mod:`.attention`), which knows from the padding mask which tokens are real, writes
  those into the pool and attends over the pool through the block tables.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.dispatch import model_dtype
from ..core.errors import CacheFullError, IncompatibleOptionsError
from .blocks import BlockCopy, BlockManager

__all__ = ["PAGED_ATTENTION_PREFIX", "PagedCache", "PagedLayer"]

logger = logging.getLogger(__name__)

#: Attention implementations registered by hf_accel are named ``"hf_accel_paged:<base>"``.
PAGED_ATTENTION_PREFIX = "hf_accel_paged:"


def uses_paged_attention(model: nn.Module) -> bool:
    """Whether ``model`` currently runs hf_accel's paged attention (its ``_attn_implementation`` is a paged one)."""
    impl = getattr(model.config, "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith(PAGED_ATTENTION_PREFIX)


def token_slots(table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Pool slots of a sequence's first ``n`` tokens through its block ``table`` ([blocks]) -> [n] int64."""
    t = torch.arange(n, device=table.device)
    return table.long()[t // block_size] * block_size + t % block_size


#: Attribute set on the K tensor ``update`` returns: the :class:`PagedLayer` it belongs to.
LAYER_TAG = "_hf_accel_paged_layer"

_CPU_DEFAULT_CAP = 4 << 30


def _default_budget(device: torch.device) -> int:
    """Bytes a pool may reserve when the user gives neither ``num_blocks`` nor ``max_memory``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = _CPU_DEFAULT_CAP * 4
    return min(_CPU_DEFAULT_CAP, available // 4)


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


def _packed_rows(lengths: list[int], q_pos: torch.Tensor, tables: torch.Tensor, short_max: int) -> PackedRows:
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    short = [i for i, n in enumerate(lengths) if n <= short_max]
    width = max([lengths[i] for i in short], default=1)
    arange = torch.arange(width)
    real = arange[None, :] < torch.tensor([lengths[i] for i in short], dtype=torch.long).reshape(-1, 1)  # [Rs, Qs]
    starts = torch.tensor([offsets[i] for i in short], dtype=torch.long).reshape(-1, 1)
    index = torch.where(real, starts + arange[None, :], 0)  # [Rs, Qs]
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
class _Step:
    """What one forward pass writes: computed at its first layer, reused by every other layer."""

    q_len: int
    valid: torch.Tensor  # [B, Q] bool: real (stored) tokens of this chunk
    all_valid: bool
    slots: torch.Tensor  # [N] int64: pool slot of each valid token, row-major
    copies: list[BlockCopy]
    block_tables: torch.Tensor  # [B, MB] int32
    q_pos: torch.Tensor  # [B, Q] int32: index of each query in its sequence, -1 for padding / released rows
    fresh: list[bool]  # per row: nothing stored before this chunk
    ctx_slots: list[torch.Tensor | None]  # per row: slots of its whole context (dense path), lazily
    last_layer: int = -1
    packed: PackedRows | None = None
    on_device: dict[torch.device, dict[str, torch.Tensor]] = field(default_factory=dict)

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self.on_device:
            names = ("valid", "slots", "block_tables", "q_pos")
            self.on_device[device] = {n: getattr(self, n).to(device) for n in names}
        return self.on_device[device]


class PagedLayer(CacheLayerMixin):
    """One decoder layer's K/V pools. Sequence bookkeeping lives in the owning :class:`PagedCache`."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(
        self,
        cache: PagedCache,
        layer_idx: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.device = device
        self.dtype = dtype
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # never read before written
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.is_initialized = True
        self._pending = False

    def __repr__(self) -> str:
        return f"PagedLayer({self.layer_idx})"

    # --- CacheLayerMixin contract (sequence state is the cache's) ---
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # the pool keeps its storage; the cache drops the tables
        self._pending = False

    def offload(self) -> None:
        raise IncompatibleOptionsError("PagedCache does not support offloading; size the pool instead")

    def prefetch(self) -> None:
        return None

    # --- pool access ---
    def write(self, key: torch.Tensor, value: torch.Tensor, step: _Step) -> None:
        """Store the real tokens of this chunk. ``key``/``value``: [B, H_kv, Q, D]."""
        self._pending = False
        t = step.tensors(self.device)
        self.copy_blocks(step.copies)
        if t["slots"].numel() == 0:
            return
        k = key.transpose(1, 2)  # [B, Q, H_kv, D]
        v = value.transpose(1, 2)
        if step.all_valid:
            k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        else:
            k, v = k[t["valid"]], v[t["valid"]]  # [N, H_kv, D]
        flat = (-1, *self.keys.shape[2:])
        self.keys.view(flat).index_copy_(0, t["slots"], k.to(self.dtype))
        self.values.view(flat).index_copy_(0, t["slots"], v.to(self.dtype))

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write of shared partial blocks: each copy's first tokens from ``src`` to ``dst``."""
        for c in copies:
            self.keys[c.dst, : c.num_tokens] = self.keys[c.src, : c.num_tokens]
            self.values[c.dst, : c.num_tokens] = self.values[c.src, : c.num_tokens]

    def context(self, row: int, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s whole stored context, gathered: ``[H_kv, S, D]`` each (dense path only)."""
        slots = self.cache._context_slots(row, step).to(self.device)
        flat = (-1, *self.keys.shape[2:])
        k = self.keys.view(flat).index_select(0, slots).transpose(0, 1)
        v = self.values.view(flat).index_select(0, slots).transpose(0, 1)
        return k, v


def _kv_geometry(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, _local_kv_heads(model, kv_heads), head_dim


def _local_kv_heads(model: nn.Module, kv_heads: int) -> int:
    """K/V heads this rank computes: a column-wise sharded ``k_proj`` (tensor parallelism) splits them."""
    from ..core.dispatch import tp_size, tp_style

    tp = tp_size(model)
    if tp == 1:
        return kv_heads
    style = next((tp_style(model, n) for n, _ in model.named_modules() if n.endswith("self_attn.k_proj")), None)
    if style != "colwise":  # replicated (e.g. "colwise_gather_output") or fused qkv: every rank holds all heads
        return kv_heads
    if kv_heads % tp:
        raise IncompatibleOptionsError(
            f"PagedCache: {kv_heads} K/V heads cannot be split over a tensor-parallel degree of {tp}"
        )
    return kv_heads // tp


def _layer_devices(model: nn.Module, num_layers: int) -> list[torch.device]:
    """The device each decoder layer computes on, so each pool sits next to its layer."""
    from ..core.dispatch import execution_device
    from ..core.registry import get_attr_path, get_spec

    layers = get_attr_path(model, get_spec(model).layers)
    # accelerate: an offloaded layer's weights are on "meta"; it computes on its hook's execution device
    return [execution_device(layer) or torch.device("cpu") for layer in list(layers)[:num_layers]]


class PagedCache(Cache):
    """A paged KV cache for ``model.generate`` (on a model patched by :func:`hf_accel.patch_model`).

    Args:
        model: the causal LM this cache is for; K/V shapes, dtype and per-layer devices are taken from it.
        num_blocks: blocks in the pool; ``None`` sizes the pool from ``max_memory``.
        block_size: tokens per block.
        max_memory: bytes all layers' pools may reserve together; ``None``: half the free GPU memory, or on CPU
            a quarter of the available RAM capped at 4 GiB. Pools are allocated with ``torch.empty``, so untouched
            CPU pages cost nothing until used.
        prefix_cache: publish full blocks of finished prompts/sequences and reuse them for later prompts that
            start with the same tokens (across ``generate`` calls that pass this cache).
        attention: ``"auto"`` (native kernel on CPU when available, else gather), ``"kernel"`` or ``"gather"``
            for the decode path (the prefill path always attends densely per row).

    Raises:
        IncompatibleOptionsError: a bad size, or a pool too small for a single block.

    Example::

        cache = hf_accel.PagedCache(model, max_memory=512 << 20)
        out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=64)
        cache.stats()["utilisation"]
    """

    ATTENTION_MODES = ("auto", "kernel", "gather")

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_memory: int | None = None,
        prefix_cache: bool = True,
        attention: str = "auto",
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise IncompatibleOptionsError(f"PagedCache.block_size must be an int >= 1, got {block_size!r}")
        if num_blocks is not None and (
            isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1
        ):
            raise IncompatibleOptionsError(f"PagedCache.num_blocks must be an int >= 1 or None, got {num_blocks!r}")
        if attention not in self.ATTENTION_MODES:
            raise IncompatibleOptionsError(
                f"PagedCache.attention must be one of {', '.join(map(repr, self.ATTENTION_MODES))}, got {attention!r}"
            )
        num_layers, kv_heads, head_dim = _kv_geometry(model)
        dtype = model_dtype(model)
        devices = _layer_devices(model, num_layers)
        token_bytes = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        block_bytes = num_layers * block_size * token_bytes
        if num_blocks is None:
            budget = max_memory if max_memory is not None else _default_budget(devices[0])
            num_blocks = budget // block_bytes
            if num_blocks < 1:
                raise IncompatibleOptionsError(
                    f"PagedCache.max_memory={budget} bytes holds no block: one block of {block_size} tokens over "
                    f"{num_layers} layers takes {block_bytes} bytes"
                )
        self.config = model.config
        self.model_type = getattr(model.config, "model_type", type(model).__name__)
        self._model_id = id(model)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.block_bytes = block_bytes
        self.prefix_cache = prefix_cache
        self.attention = attention
        self.manager = BlockManager(num_blocks, block_size)
        layers = [
            PagedLayer(self, i, num_blocks, block_size, kv_heads, head_dim, dtype, devices[i])
            for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self._rows: list[int | None] = []  # per batch row: sequence id, or None once released
        self._length = 0  # logical (padded) length, what Transformers sees
        self._step: _Step | None = None
        self._pinned: _Step | None = None
        self._prefix_hit_tokens = 0
        self._prompt_tokens = 0
        self.peak_blocks_used = 0

    @classmethod
    def from_config(cls, model: nn.Module, config: Any) -> PagedCache:
        """A cache sized and configured by a :class:`~hf_accel.PagedConfig`."""
        return cls(
            model,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_memory=config.max_memory,
            prefix_cache=config.prefix_cache,
            attention=config.attention,
        )

    # ------------------------------------------------------------------------------------ reporting
    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds (all sequences together)."""
        return self.num_blocks * self.block_size

    def __repr__(self) -> str:
        reserved = self.num_blocks * self.block_bytes
        return (
            f"PagedCache(model_type={self.model_type!r}, layers={len(self.layers)}, blocks={self.num_blocks}, "
            f"block_size={self.block_size}, tokens={self.max_tokens}, reserved={reserved / 2**20:.1f} MiB, "
            f"dtype={str(self.dtype).removeprefix('torch.')}, rows={len(self._rows)}, seq_length={self._length})"
        )

    def stats(self) -> dict[str, float | int]:
        """Block and memory accounting.

        Returns:
            ``blocks_total``, ``blocks_used`` (held by live rows), ``blocks_cached`` (held only by the prefix
            table), ``blocks_free``, ``blocks_shared`` (by more than one row), ``bytes_reserved``, ``bytes_live``
            (K/V bytes of tokens live rows hold), ``utilisation`` (``bytes_live`` / bytes of the blocks in use),
            ``live_tokens``, ``prefix_hit_tokens`` / ``prompt_tokens`` (since construction),
            ``peak_blocks_used`` (since the last :meth:`start`, i.e. during the last ``generate`` call).
        """
        m = self.manager
        live_tokens = sum(m.num_tokens(s) for s in self._rows if s is not None)
        live_blocks = {b for s in self._rows if s is not None for b in m.block_table(s)}
        cached_only = m.num_evictable
        token_bytes = self.block_bytes // self.block_size
        in_use = len(live_blocks) * self.block_bytes
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": len(live_blocks),
            "blocks_cached": cached_only,
            "blocks_free": m.num_free,
            "blocks_shared": m.num_shared(),
            "bytes_reserved": self.num_blocks * self.block_bytes,
            "bytes_live": live_tokens * token_bytes,
            "utilisation": (live_tokens * token_bytes / in_use) if in_use else 1.0,
            "live_tokens": live_tokens,
            "prefix_hit_tokens": self._prefix_hit_tokens,
            "prompt_tokens": self._prompt_tokens,
            "peak_blocks_used": self.peak_blocks_used,
        }

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
        """Hand this layer's new K/V ([B, H_kv, Q, D]) to the paged attention function, tagged with the layer.

        Raises:
            IncompatibleOptionsError: the model does not run hf_accel's paged attention, or K/V do not match the
                pool (another model, dtype or device).
        """
        impl = getattr(self.config, "_attn_implementation", None) or ""
        if not impl.startswith(PAGED_ATTENTION_PREFIX):
            raise IncompatibleOptionsError(
                f"PagedCache needs hf_accel's paged attention, but the model's attention implementation is {impl!r}; "
                "patch the model first: hf_accel.patch_model(model) (the 'paged' feature)"
            )
        layer = self.layers[layer_idx]
        if key_states.shape[1] != self.kv_heads or key_states.shape[-1] != self.head_dim:
            raise IncompatibleOptionsError(
                f"PagedCache was built for K/V of {self.kv_heads} heads x {self.head_dim} dims, got "
                f"{tuple(key_states.shape)}: a PagedCache belongs to the model it was built for"
            )
        if key_states.dtype != layer.dtype or key_states.device != layer.device:
            raise IncompatibleOptionsError(
                f"PagedCache layer {layer_idx} holds {layer.dtype} on {layer.device}, but the model produced "
                f"{key_states.dtype} on {key_states.device}; build the cache after moving/casting the model"
            )
        if layer._pending:
            raise RuntimeError(
                f"layer {layer_idx}'s previous K/V never reached hf_accel's paged attention: the attention function "
                "of this architecture does not consume the cache's output; paged generation is unsupported here"
            )
        layer._pending = True
        setattr(key_states, LAYER_TAG, layer)
        return key_states, value_states

    def reset(self) -> None:
        """Drop every row (their blocks return to the pool); published prefix blocks stay cached."""
        for seq in self._rows:
            if seq is not None:
                self.manager.free(seq)
        self._rows = []
        self._length = 0
        self._step = None
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every row (speculative rollback); frees blocks."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        n = -tokens_to_remove
        if n == 0:
            return
        if n > self._length:
            raise ValueError(f"cannot remove {n} tokens from a cache of {self._length}")
        for seq in self._rows:
            if seq is None:
                continue
            have = self.manager.num_tokens(seq)
            if have < n:
                raise ValueError(f"cannot remove {n} tokens from a row that holds {have} real tokens")
            self.manager.truncate(seq, have - n)
        self._length -= n
        self._step = None

    def rollback_rows(self, drop: Sequence[int], logical: int) -> None:
        """Per-row rollback (speculative decoding with rows that accepted different numbers of drafts).

        Args:
            drop: real tokens to remove from the end of each row (rows released already are skipped).
            logical: tokens to remove from the logical, padded length Transformers sees.
        """
        if len(drop) != len(self._rows):
            raise ValueError(f"rollback_rows got {len(drop)} counts for {len(self._rows)} rows")
        if not 0 <= logical <= self._length:
            raise ValueError(f"cannot remove {logical} tokens from a cache of {self._length}")
        for seq, n in zip(self._rows, drop, strict=True):
            if seq is None or n == 0:
                continue
            have = self.manager.num_tokens(seq)
            if not 0 <= n <= have:
                raise ValueError(f"cannot remove {n} tokens from a row that holds {have} real tokens")
            self.manager.truncate(seq, have - n)
        self._length -= logical
        self._step = None

    def dense(self, layer_idx: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s stored K/V laid out padded, as ``mask`` says (a copy for a padded consumer, such
        as a draft model's own ``DynamicCache``).

        Args:
            layer_idx: the decoder layer.
            mask: ``[B, T]``; row ``b``'s 1-entries, in order, receive the tokens row ``b`` holds.

        Returns:
            ``(keys, values)``, each ``[B, H_kv, T, D]`` on the layer's device; zeros where ``mask`` is 0.

        Raises:
            ValueError: ``mask`` has another number of rows, or a row's 1-entries differ from the tokens it holds.
        """
        layer = self.layers[layer_idx]
        if mask.dim() != 2 or mask.shape[0] != len(self._rows):
            raise ValueError(f"dense needs a [{len(self._rows)}, T] mask, got {tuple(mask.shape)}")
        heads, dim = layer.keys.shape[2:]
        keys = layer.keys.new_zeros(mask.shape[0], heads, mask.shape[1], dim)  # [B, H_kv, T, D]
        values = torch.zeros_like(keys)
        flat = (-1, heads, dim)
        for row, seq in enumerate(self._rows):
            cols = mask[row].to("cpu").nonzero().flatten()
            held = self.manager.num_tokens(seq) if seq is not None else 0
            if held != cols.numel():
                raise ValueError(f"row {row} holds {held} tokens but its mask has {cols.numel()} positions")
            if held == 0:
                continue
            table = torch.tensor(self.manager.block_table(seq), dtype=torch.int64)
            slots = token_slots(table, held, self.block_size).to(layer.device)
            cols = cols.to(layer.device)
            keys[row][:, cols] = layer.keys.view(flat).index_select(0, slots).transpose(0, 1)  # [H_kv, n, D]
            values[row][:, cols] = layer.values.view(flat).index_select(0, slots).transpose(0, 1)
        return keys, values

    def _remap_rows(self, sources: Sequence[int]) -> None:
        new_rows = [None if self._rows[i] is None else self.manager.fork(self._rows[i]) for i in sources]
        for seq in self._rows:
            if seq is not None:
                self.manager.free(seq)
        self._rows = new_rows
        self._step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``j`` becomes a fork of old row ``beam_idx[j]`` (block tables are shared, not copied)."""
        self._remap_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap_rows([i for i in range(len(self._rows)) for _ in range(repeats)])

    # ------------------------------------------------------------------------------- requests
    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Begin a new batch of prompts: drop the previous rows and adopt cached prefixes.

        Args:
            input_ids: ``[B, L]`` left-padded prompts.
            attention_mask: ``[B, L]`` (1 = token, 0 = left padding), or ``None``.

        Returns:
            The logical length already in the cache (0 without a prefix hit); ``generate`` continues from there.

        Raises:
            IncompatibleOptionsError: right padding or holes in ``attention_mask``.
            CacheFullError: the prompts alone need more blocks than the pool has.
        """
        self.reset()
        self.peak_blocks_used = 0  # per call: the high-water mark of this batch
        real = _real_tokens(input_ids, attention_mask)
        pads = [input_ids.shape[1] - len(toks) for toks in real]
        need = sum(-(-len(toks) // self.block_size) for toks in real)
        if need > self.num_blocks:
            raise CacheFullError(
                need,
                self.num_blocks,
                f"the {len(real)} prompts alone need {need} blocks of {self.block_size} tokens but the pool has "
                f"{self.num_blocks}; raise num_blocks/max_memory or send fewer/shorter prompts",
            )
        matches = [self.manager.match_prefix(t[:-1]) if self.prefix_cache else [] for t in real]
        start = min(p + len(m) * self.block_size for p, m in zip(pads, matches, strict=True))
        for toks, pad, blocks in zip(real, pads, matches, strict=True):
            adopted = max(0, start - pad)
            self._rows.append(self.manager.adopt(blocks, adopted) if adopted else self.manager.new_sequence())
            self._prefix_hit_tokens += adopted
            self._prompt_tokens += len(toks)
        self._length = start
        return start

    def publish(self, sequences: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Publish the full blocks of each live row (its real tokens from ``sequences``) in the prefix table."""
        if not self.prefix_cache:
            return
        for row, toks in enumerate(_real_tokens(sequences, attention_mask)):
            seq = self._rows[row] if row < len(self._rows) else None
            if seq is not None:
                self.manager.publish(seq, toks[: self.manager.num_tokens(seq)])

    def release(self, row: int, tokens: Sequence[int] | None = None) -> None:
        """Row ``row`` finished: publish its blocks (if ``tokens`` and prefix caching) and free them."""
        seq = self._rows[row]
        if seq is None:
            return
        if tokens is not None and self.prefix_cache:
            self.manager.publish(seq, list(tokens)[: self.manager.num_tokens(seq)])
        self.manager.free(seq)
        self._rows[row] = None
        self._step = None

    def released(self, row: int) -> bool:
        return self._rows[row] is None

    def clear_prefix_cache(self) -> None:
        self.manager.clear_prefix_cache()

    # --------------------------------------------------------------------------- per forward
    def step_for(self, layer_idx: int, batch: int, q_len: int, padding: torch.Tensor | None) -> _Step:
        """The current forward's write plan; a new one starts when layer indices stop increasing.

        Args:
            layer_idx: the layer asking.
            batch: rows in the forward.
            q_len: tokens per row in this chunk.
            padding: ``[B, Q]`` bool, True where the chunk's token is real; ``None`` = all real.
        """
        if self._pinned is not None:
            return self._pinned
        step = self._step
        if step is None or layer_idx <= step.last_layer or step.q_len != q_len:
            step = self._plan(batch, q_len, padding)
            self._step = step
        step.last_layer = layer_idx
        return step

    def _plan(self, batch: int, q_len: int, padding: torch.Tensor | None) -> _Step:
        if not self._rows and self._length == 0:  # a forward without start(), e.g. a plain model(...) call
            self._rows = [self.manager.new_sequence() for _ in range(batch)]
        if batch != len(self._rows):
            raise IncompatibleOptionsError(
                f"PagedCache holds {len(self._rows)} rows but the model got a batch of {batch}; "
                "call cache.start(...) for a new batch (a PagedCache serves one batch at a time)"
            )
        B = len(self._rows)
        valid = padding.to("cpu", torch.bool) if padding is not None else torch.ones(B, q_len, dtype=torch.bool)
        alive = torch.tensor([s is not None for s in self._rows])
        valid = valid & alive[:, None]
        counts = valid.sum(1).tolist()
        m = self.manager
        needed = sum(m.blocks_needed(s, c) for s, c in zip(self._rows, counts, strict=True) if s is not None)
        available = m.num_free + m.num_evictable
        if needed > available:
            raise CacheFullError(
                needed,
                available,
                f"this step needs {needed} more blocks of {self.block_size} tokens for {B} rows but {available} "
                f"are free ({self.num_blocks} total); raise num_blocks/max_memory, or lower the batch size or "
                "max_new_tokens",
            )
        slots: list[int] = []
        copies: list[BlockCopy] = []
        before = []
        for seq, count in zip(self._rows, counts, strict=True):
            before.append(m.num_tokens(seq) if seq is not None else 0)
            if seq is None or count == 0:
                continue
            got = m.append_slots(seq, count)
            if got is None:  # cannot happen after the check above; keep the state honest if it does
                raise CacheFullError(needed, m.num_free, "block reclaim failed")
            slots.extend(got[0])
            copies.extend(got[1])
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - m.num_free - m.num_evictable)
        rank = valid.to(torch.int32).cumsum(1) - 1  # index of each real token among the chunk's real tokens
        q_pos = torch.where(valid, rank + torch.tensor(before, dtype=torch.int32)[:, None], -1).to(torch.int32)
        block_tables = _block_tables(m, self._rows)
        self._length += q_len
        return _Step(
            q_len=q_len,
            valid=valid,
            all_valid=bool(valid.all()),
            slots=torch.tensor(slots, dtype=torch.int64),
            copies=copies,
            block_tables=block_tables,
            q_pos=q_pos,
            fresh=[b == 0 for b in before],
            ctx_slots=[None] * B,
        )

    def decode_plan(
        self, batch: int, padding: torch.Tensor | None, q_len: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plan a short chunk for a forward that writes the pools itself (the compiled decode step).

        Allocates the chunk's slots exactly as the eager path does at its first layer and performs the
        copy-on-write block copies on every layer.

        Args:
            batch: rows in the forward.
            padding: ``[B, Q]`` True where the row's token is real; ``None`` = all real.
            q_len: tokens per row in the chunk (1 for a decode step, more for a speculative verification).

        Returns:
            ``slots`` ``[B*Q]`` int64 (-1: the token is not stored), ``block_tables`` ``[B, MB]`` int32 and
            ``q_pos`` ``[B, Q]`` int32 (-1: the token attends to nothing), on the first layer's device.

        Raises:
            CacheFullError / IncompatibleOptionsError: as for any forward (pool exhausted, wrong batch).
        """
        step = self._plan(batch, q_len, padding)
        self._step = None  # the plan is this step's only; an eager forward after it plans its own
        for layer in self.layers:
            layer.copy_blocks(step.copies)
        slots = torch.full((batch * q_len,), -1, dtype=torch.int64)
        slots[step.valid.flatten()] = step.slots  # row-major, as the rows' slots were allocated
        device = self.layers[0].device
        return slots.to(device), step.block_tables.to(device), step.q_pos.to(device)

    def pin_packed(
        self,
        seqs: Sequence[int],
        starts: Sequence[int],
        slots: Sequence[int],
        copies: list[BlockCopy],
        short_max: int = 16,
    ) -> None:
        """Plan the next forward as a packed chunk: sequence ``seqs[i]`` feeds tokens at positions ``starts[i]..``.

        The caller (:class:`hf_accel.Engine`) has already reserved the slots with the block manager; the chunk's
        tokens are laid out row after row (``[1, N]``, ``N = len(slots)``). Every layer of the next forward uses
        this plan; :meth:`unpin` ends it.
        """
        m = self.manager
        total = [m.num_tokens(s) for s in seqs]
        lengths = [t - b for t, b in zip(total, starts, strict=True)]
        if sum(lengths) != len(slots):
            raise ValueError(f"{len(slots)} slots for {sum(lengths)} packed tokens")
        R, width = len(seqs), max(lengths)
        arange = torch.arange(width)
        real = arange[None, :] < torch.tensor(lengths)[:, None]  # [R, Qmax]
        q_pos = torch.where(real, torch.tensor(starts)[:, None] + arange[None, :], -1).to(torch.int32)
        block_tables = _block_tables(m, seqs)
        self._rows = list(seqs)
        self._pinned = _Step(
            q_len=len(slots),
            valid=torch.ones(1, len(slots), dtype=torch.bool),
            all_valid=True,
            slots=torch.tensor(list(slots), dtype=torch.int64),
            copies=copies,
            block_tables=block_tables,
            q_pos=q_pos,
            fresh=[b == 0 for b in starts],
            ctx_slots=[None] * R,
            packed=_packed_rows(lengths, q_pos, block_tables, short_max),
        )
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - m.num_free - m.num_evictable)

    def unpin(self) -> None:
        """End a packed plan (rows are the engine's, not the cache's: nothing is freed)."""
        self._pinned = None
        self._rows = []
        self._step = None

    def _context_slots(self, row: int, step: _Step) -> torch.Tensor:
        cached = step.ctx_slots[row]
        if cached is None:
            seq = self._rows[row]
            n = self.manager.num_tokens(seq) if seq is not None else 0
            table = torch.tensor(self.manager.block_table(seq) if seq is not None else [], dtype=torch.int64)
            cached = token_slots(table, n, self.block_size)
            step.ctx_slots[row] = cached
        return cached


def _block_tables(manager: BlockManager, seqs: Sequence[int | None]) -> torch.Tensor:
    """``[R, max blocks]`` int32 block tables of ``seqs`` (zero-padded; a released row, ``None``, is all padding)."""
    tables = [manager.block_table(s) if s is not None else [] for s in seqs]
    out = torch.zeros(len(tables), max(1, max(len(t) for t in tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def _real_tokens(ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens without its left padding; rejects right padding and holes."""
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
