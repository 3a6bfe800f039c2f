"""Multi-token masked attention with grouped K/V heads on CPU, without copying the K/V (pure torch).

Transformers' ``sdpa`` attention copies every layer's K/V ``num_key_value_groups`` times (``repeat_kv``)
whenever a chunk of more than one query comes with a mask on CPU: a prefill with padding, a speculative
verification chunk, a catch-up chunk of a draft. On SmolLM2 (3 K/V heads, 3 groups) at a context of ~450 tokens
a 9-token forward took 160 ms with the copies and 106 ms without (one-off measurement, docs/speculative.md).
PyTorch's SDPA (>= 2.5) takes the grouped heads directly (``enable_gqa=True``) and gives the same result (checked
bitwise by the tests), so this path runs it that way; every other call goes to Transformers' function unchanged.

The paged attention function takes this path for calls without a ``PagedCache``. ``generate`` calls without
``paged=`` run on :data:`GQA_ATTENTION` (registered by :func:`register_gqa` at patch time for models whose base
implementation is ``sdpa``): this path, else Transformers' ``sdpa``, with Transformers' own ``sdpa`` mask function,
so such a call sees no paged machinery at all. Measured on SmolLM2 (one-off): a speculative verification chunk
of 4 rows x 13 tokens at a ~580-token context spent ~45 ms of its ~220 ms in ``repeat_kv`` copies.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .interface import acquire, release

__all__ = ["GQA_ATTENTION", "gqa_attention", "gqa_sdpa", "register_gqa", "release_gqa"]

#: The attention implementation of a patched ``sdpa`` model's calls without a ``PagedCache``
GQA_ATTENTION = "hf_accel_gqa:sdpa"

# keyword arguments Transformers' sdpa function acts on; any of them set means the plain path must run
_HANDLED_ELSEWHERE = ("softcap", "position_bias", "output_attentions", "s_aux", "sinks")


@functools.cache
def _torch_has_gqa() -> bool:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def gqa_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """Attention for a masked multi-query chunk with grouped K/V heads, or ``None`` where it does not apply.

    Args:
        module: the attention module (its ``num_key_value_groups`` says how many query heads share a K/V head).
        query: ``[B, H_q, Q, D]``.
        key / value: ``[B, H_kv, T, D]``.
        attention_mask: ``[B or 1, 1, Q, T]`` bool (True = attend) or additive float mask.
        scaling: softmax scale (``None``: ``1/sqrt(D)``).
        dropout: attention dropout probability (only 0 is handled here).
        kwargs: the other keyword arguments of the attention call.

    Returns:
        ``[B, Q, H_q, D]`` (Transformers' attention output layout), or ``None``: run Transformers' ``sdpa``
        (one query, no mask, not CPU, no grouped heads, dropout, or an option this path does not cover).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups <= 1
        or query.shape[2] <= 1
        or query.device.type != "cpu"
        or not isinstance(attention_mask, torch.Tensor)
        or attention_mask.ndim != 4
        or dropout != 0.0
        or any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _HANDLED_ELSEWHERE)
        or not _torch_has_gqa()
    ):
        return None
    # out: [B, H_q, Q, D]; query head h reads K/V head h // groups, as after repeat_kv
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def gqa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' ``sdpa`` attention, except that masked multi-query chunks with grouped K/V heads on CPU run
    :func:`gqa_sdpa` (same result, no K/V copies). Shapes as Transformers' attention functions: ``query
    [B, H_q, Q, D]``, ``key / value [B, H_kv, T, D]``; returns ``([B, Q, H_q, D], None)``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out = gqa_sdpa(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if out is not None:
        return out, None
    return ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


def register_gqa() -> str:
    """Hold :data:`GQA_ATTENTION` in Transformers' attention interface (:func:`gqa_attention`) and mask interface
    (the ``sdpa`` mask function itself) for one more user; returns the name. Called at patch time, never at import;
    :func:`release_gqa` gives it back."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    acquire(GQA_ATTENTION, lambda: gqa_attention, lambda: ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return GQA_ATTENTION


def release_gqa() -> None:
    """One user of :data:`GQA_ATTENTION` fewer (the last removes it from Transformers' interfaces)."""
    release(GQA_ATTENTION)
