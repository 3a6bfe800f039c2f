"""A paged cache's K/V laid out densely: the hand-over to consumers of Transformers' padded caches (a
self-speculative draft starting from the target's prompt)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.errors import IncompatibleOptionsError
from ..kernels.reference import token_slots

if TYPE_CHECKING:
    from .cache import PagedCache

__all__ = ["dense_kv"]


def dense_kv(cache: PagedCache, layer_idx: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer_idx``'s stored K/V laid out padded, as ``mask`` says (a copy).

    Args:
        cache: the paged cache.
        layer_idx: the decoder layer.
        mask: ``[B, T]``; row ``b``'s 1-entries, in order, receive the tokens row ``b`` holds.

    Returns:
        ``(keys, values)``, each ``[B, H_kv, T, D]`` on the layer's device; zeros where ``mask`` is 0.

    Raises:
        ValueError: ``mask`` has another number of rows, or a row's 1-entries differ from the tokens it holds.
    """
    layer = cache.layers[layer_idx]
    rows = cache.row_sequences()
    if mask.dim() != 2 or mask.shape[0] != len(rows):
        raise IncompatibleOptionsError(f"dense needs a [{len(rows)}, T] mask, got {tuple(mask.shape)}")
    heads, dim = layer.keys.shape[2:]
    keys = layer.keys.new_zeros(mask.shape[0], heads, mask.shape[1], dim)  # [B, H_kv, T, D]
    values = torch.zeros_like(keys)
    flat = (-1, heads, dim)
    for row, seq in enumerate(rows):
        cols = mask[row].to("cpu").nonzero().flatten()
        held = cache.manager.num_tokens(seq) if seq is not None else 0
        if held != cols.numel():
            raise IncompatibleOptionsError(f"row {row} holds {held} tokens but its mask has {cols.numel()} positions")
        if held == 0:
            continue
        slots = token_slots(cache.tables.row(seq), held, cache.block_size).to(layer.device)
        cols = cols.to(layer.device)
        keys[row][:, cols] = layer.keys.view(flat).index_select(0, slots).transpose(0, 1)  # [H_kv, n, D]
        values[row][:, cols] = layer.values.view(flat).index_select(0, slots).transpose(0, 1)
    return keys, values
