"""A draft's KV cache that appends in place: Transformers' ``DynamicLayer`` with spare capacity.

``DynamicLayer.update`` concatenates the whole history with each new token, so a one-token step copies every
layer's K/V (at SmolLM2's ~450-token context, ~2 ms of a ~15 ms int8 draft step). :class:`GrowingLayer` keeps
its K/V as the leading part of a larger buffer and writes new tokens after it; ``keys`` / ``values`` stay views
of the valid part, so ``crop`` (a slice), ``batch_select_indices`` (a copy, after which the next update makes a
new buffer) and everything else of the ``DynamicLayer`` contract behave as before. A writer asking for another
dtype (the native draft layers keep float16 K/V; a module forward writes float32) gets the buffer converted once,
values beyond the new dtype's range saturated.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "growing_cache", "rollback_cache", "to_growing"]


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update`` writes into spare capacity instead of concatenating.

    :meth:`reserve` and :meth:`commit` split an update in two for a writer that fills the buffers itself (the
    native lean layers): reserve room for ``new`` tokens, write columns ``[used, used + new)``, commit.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states / value_states: [B, H_kv, S_new, D]
        batch, heads, new, dim = key_states.shape
        buf_k, buf_v, used = self.reserve(batch, heads, new, dim, key_states.dtype, key_states.device)
        buf_k[:, :, used : used + new] = key_states
        buf_v[:, :, used : used + new] = value_states
        return self.commit(used + new)

    def reserve(
        self, batch: int, heads: int, new: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make room for ``new`` more tokens; returns ``(keys buffer, values buffer, used)``.

        The buffers are contiguous ``[B, H_kv, capacity, D]`` holding the layer's ``used`` tokens in their first
        columns; nothing is visible until :meth:`commit`.
        """
        shape = (batch, heads, dim, dtype, device)
        committed = self.__dict__.get("_committed")  # (keys, values, shape) as the last commit left them
        same = committed is not None and committed[0] is self.keys and committed[1] is self.values
        if same and committed[2] == shape:
            # fast path (every decode step): nobody replaced the views since, so they still lead the buffers
            used = self.keys.shape[-2]
            if used + new <= self._buf_k.shape[-2]:
                return self._buf_k, self._buf_v, used
        if not self.is_initialized:
            empty = torch.empty(batch, heads, 0, dim, dtype=dtype, device=device)
            self.lazy_initialization(empty, empty)
        used = self.keys.shape[-2] if self.keys.numel() else 0
        need = used + new
        buf_k = getattr(self, "_buf_k", None)
        if buf_k is None or need > buf_k.shape[-2] or not _leads(self.keys, buf_k, used, shape):
            self._buf_k = _grow(self.keys, shape, used, need)
            self._buf_v = _grow(self.values, shape, used, need)
        self._shape = shape
        return self._buf_k, self._buf_v, used

    def commit(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the first ``length`` columns of the buffers the layer's keys and values; returns them."""
        self.keys, self.values = self._buf_k.narrow(2, 0, length), self._buf_v.narrow(2, 0, length)  # [B, H_kv, T, D]
        self._committed = (self.keys, self.values, self._shape)
        return self.keys, self.values


def _leads(valid: torch.Tensor, buf: torch.Tensor, used: int, shape: tuple) -> bool:
    """Whether ``buf`` fits ``shape`` (rows, heads, head size, dtype, device) and ``valid`` is still
    ``buf[:, :, :used]`` (not replaced by a batch selection's copy)."""
    batch, heads, dim, dtype, device = shape
    if buf.shape[:2] != (batch, heads) or buf.shape[-1] != dim or buf.dtype != dtype or buf.device != device:
        return False
    return used == 0 or (valid.data_ptr() == buf.data_ptr() and valid.stride() == buf.stride())


def _grow(valid: torch.Tensor, shape: tuple, used: int, need: int) -> torch.Tensor:
    """A buffer with room for ``need`` tokens and ~25% (at least 128 tokens) more, holding ``valid``'s tokens."""
    batch, heads, dim, dtype, device = shape
    capacity = max(need + need // 4, need + 128)
    buf = torch.empty(batch, heads, capacity, dim, dtype=dtype, device=device)  # [B, H_kv, capacity, D]
    if used:
        converting = valid.dtype.is_floating_point and dtype.is_floating_point and valid.dtype != dtype
        if converting and torch.finfo(dtype).max < torch.finfo(valid.dtype).max:  # saturate, never overflow to inf
            bound = torch.finfo(dtype).max
            valid = valid.clamp(-bound, bound)
        buf[:, :, :used] = valid
    return buf


def to_growing(cache: Any) -> Any:
    """Turn the plain ``DynamicLayer`` layers of a Transformers cache into growing ones, in place; returns it.

    Layers of other kinds (sliding windows, quantized, ...) are left as they are.
    """
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is DynamicLayer:
            new = GrowingLayer()
            new.__dict__.update(layer.__dict__)  # keys / values / is_initialized / device as they were
            cache.layers[i] = new
    return cache


def growing_cache(config: Any) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers append in place."""
    return to_growing(DynamicCache(config=config))


def rollback_cache(config: Any) -> DynamicCache:
    """:func:`growing_cache`, except that a model with sliding-window layers gets full ones: Transformers'
    sliding-window layers cannot crop once the window is reached, and a speculative draft must roll back anywhere.
    (The sliding-window mask still limits what each query sees; the layers only keep older K/V too.)"""
    cache = growing_cache(config)
    if any(getattr(layer, "sliding_window", None) for layer in cache.layers):
        cache = to_growing(DynamicCache(ddp_cache_data=[(None, None)] * len(cache.layers)))  # [DynamicLayer] * L
    return cache
