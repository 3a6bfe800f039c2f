"""A draft's KV cache that appends in place: Transformers' ``DynamicLayer`` with spare capacity.

``DynamicLayer.update`` concatenates the whole history with each new token, so a one-token step copies every
layer's K/V (at SmolLM2's ~450-token context, ~2 ms of a ~15 ms int8 draft step). :class:`GrowingLayer` keeps
its K/V as the leading part of a larger buffer and writes new tokens after it; ``keys`` / ``values`` stay views
of the valid part, so ``crop`` (a slice), ``batch_select_indices`` (a copy, after which the next update makes a
new buffer) and everything else of the ``DynamicLayer`` contract behave as before.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "growing_cache", "to_growing"]


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update`` writes into spare capacity instead of concatenating."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        # key_states / value_states: [B, H_kv, S_new, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.keys.shape[-2] if self.keys.numel() else 0
        need = used + key_states.shape[-2]
        buf_k = getattr(self, "_buf_k", None)
        if buf_k is None or need > buf_k.shape[-2] or not _leads(self.keys, buf_k, used, key_states):
            self._buf_k = _grow(self.keys, key_states, used, need)
            self._buf_v = _grow(self.values, value_states, used, need)
        self._buf_k[:, :, used:need] = key_states
        self._buf_v[:, :, used:need] = value_states
        self.keys, self.values = self._buf_k[:, :, :need], self._buf_v[:, :, :need]  # [B, H_kv, need, D]
        return self.keys, self.values


def _leads(valid: torch.Tensor, buf: torch.Tensor, used: int, new: torch.Tensor) -> bool:
    """Whether ``buf`` fits ``new``'s rows and heads and ``valid`` is still ``buf[:, :, :used]`` (not replaced by a
    batch selection's copy)."""
    if buf.shape[:2] != new.shape[:2] or buf.shape[-1] != new.shape[-1] or buf.dtype != new.dtype:
        return False
    return used == 0 or (valid.data_ptr() == buf.data_ptr() and valid.stride() == buf.stride())


def _grow(valid: torch.Tensor, new: torch.Tensor, used: int, need: int) -> torch.Tensor:
    """A buffer with room for ``need`` tokens and ~25% (at least 128 tokens) more, holding ``valid``'s tokens."""
    batch, heads, _, dim = new.shape
    capacity = max(need + need // 4, need + 128)
    buf = new.new_empty(batch, heads, capacity, dim)  # [B, H_kv, capacity, D]
    if used:
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
