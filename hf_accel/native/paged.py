"""The native executor over hf_accel's paged cache: decode-sized chunks of ``generate(paged=True)`` and the Engine's
packed steps whose every request feeds a few tokens (decode, prompt-lookup drafts).

Both plan as the paged cache's other fast paths do (:meth:`~hf_accel.PagedCache.decode_plan`, or the Engine's pinned
packed plan), then run every decoder layer in one native call that writes the chunk's K/V into the pool and attends
through the block tables with the native paged kernel (``decoder_layers_paged``). Anything else (prompt chunks, a pool
the native kernel does not take, a pool on another device) returns ``None``: the model's own forward runs it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..paged.attention import DECODE_MAX_QUERY
from ..paged.cache import PagedCache
from .step import LeanStep

__all__ = ["paged_hidden", "paged_logits", "serves_pool"]


def serves_pool(step: LeanStep, cache: PagedCache) -> bool:
    """Whether the executor can run chunks over ``cache``: its paged build exists, and every layer's pool is float32
    on the CPU and taken by the native paged kernel (``layer.attention``)."""
    native = step.native
    if native is None or native.paged_fn is None or len(cache.layers) != native.num_layers:
        return False
    return all(
        layer.attention.native and layer.dtype == torch.float32 and layer.device.type == "cpu" for layer in cache.layers
    )


def paged_logits(step: LeanStep, cache: PagedCache, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The logits of a model call over ``cache`` through the executor, or ``None`` where it does not take the call.

    Args:
        step: the model's lean step (native layers with a paged build).
        cache: the call's paged cache (:func:`serves_pool` true).
        kwargs: the call's ``forward`` keyword arguments (``input_ids``, ``attention_mask``, ``position_ids``,
            ``logits_to_keep``).
    """
    ids, keep = kwargs["input_ids"], kwargs.get("logits_to_keep", 0)
    if cache.pinned_plan is not None:
        return _packed(step, cache, ids, kwargs.get("position_ids"), keep)
    run = _chunk(step, cache, kwargs)
    if run is None:
        return None
    h, mode = run
    return step.logits(h[:, -keep:] if keep else h, mode)


def paged_hidden(step: LeanStep, cache: PagedCache, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The final hidden states ``[B, C, E]`` (after the model's last norm) of a decode-sized chunk over ``cache``, as
    ``model.model`` returns them (a speculative target verifying through its screened head), or ``None``."""
    if cache.pinned_plan is not None:
        return None
    run = _chunk(step, cache, kwargs)
    return None if run is None else step.final_norm(run[0])


def _chunk(step: LeanStep, cache: PagedCache, kwargs: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
    """A decode-sized ``[B, W]`` chunk's last hidden states through the executor (planned by the cache), or
    ``None``."""
    ids, keep = kwargs["input_ids"], kwargs.get("logits_to_keep", 0)
    batch, width = ids.shape
    if width > DECODE_MAX_QUERY or not isinstance(keep, int):
        return None  # prompts attend densely per row on the model's own paged path
    positions = kwargs.get("position_ids")
    if positions is None:  # what the model computes without them: the logical length
        start = cache.get_seq_length()
        positions = torch.arange(start, start + width, device=ids.device)[None].expand(batch, -1)
    mask = kwargs.get("attention_mask")
    padding = mask[:, -width:] if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None  # [B, W]
    plan = cache.decode_plan(batch, padding, width)  # slots allocated, copy-on-write copies done
    return step.paged_hidden(ids, positions, cache.layers, plan)  # [B, W, E], the int8 mode it ran


def _packed(
    step: LeanStep, cache: PagedCache, ids: torch.Tensor, positions: torch.Tensor | None, keep: Any
) -> torch.Tensor | None:
    """The Engine's packed chunk ``[1, N]`` when every request in it feeds at most ``DECODE_MAX_QUERY`` tokens: laid
    out ``[R, Qs]`` for the executor, its hidden states scattered back to the chunk's order; ``None`` otherwise."""
    plan = cache.pinned_plan
    packed = plan.packed if plan is not None else None
    if packed is None or positions is None or len(packed.short) != len(packed.lengths):
        return None
    index, real = packed.short_index, packed.short_real  # [R, Qs]
    for layer in cache.layers:
        layer.copy_blocks(plan.copies)
    slots = torch.where(real, plan.slots[index], -1).flatten()  # [R*Qs], -1: padding
    rows = (slots, packed.short_tables, packed.short_q_pos)
    h, mode = step.paged_hidden(ids[0][index], positions[0][index], cache.layers, rows)  # [R, Qs, E]
    chunk = h.new_empty(ids.shape[1], h.shape[-1])  # [N, E] in the chunk's order
    chunk[index[real]] = h[real]
    chunk = chunk[None]  # [1, N, E]
    selected = chunk[:, keep] if isinstance(keep, torch.Tensor) else (chunk[:, -keep:] if keep else chunk)
    return step.logits(selected, mode)
