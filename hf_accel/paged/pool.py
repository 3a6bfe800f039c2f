"""How big a paged KV pool is and where each layer's part of it lives (no Transformers import).

:func:`pool_spec` reads a model's K/V geometry (layers, K/V heads this rank computes, head size), dtype and the
device each decoder layer computes on, and sizes the pool from ``num_blocks`` or a byte budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ..core.dispatch import execution_device, model_dtype, tp_size, tp_style
from ..core.errors import IncompatibleOptionsError
from ..core.registry import get_attr_path, get_spec

__all__ = ["PoolSpec", "pool_spec"]

_CPU_DEFAULT_CAP = 4 << 30


@dataclass(frozen=True)
class PoolSpec:
    """The geometry of one model's paged pool.

    Args:
        num_layers / kv_heads / head_dim: per-token K/V shape (``kv_heads`` as this rank computes them).
        dtype: the K/V dtype (the model's).
        devices: the device of each layer's pool (its layer's execution device).
        block_size / num_blocks: tokens per block, blocks in the pool.
        block_bytes: bytes of one block over every layer (K and V).
        why: where ``num_blocks`` comes from (``num_blocks=``, ``max_memory=`` or the default budget).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    devices: tuple[torch.device, ...]
    block_size: int
    num_blocks: int
    block_bytes: int
    why: str = ""


def _default_budget(device: torch.device) -> tuple[int, str]:
    """Bytes a pool may reserve when the user gives neither ``num_blocks`` nor ``max_memory``, and why."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2, f"default budget: half the free memory of {device}"
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = _CPU_DEFAULT_CAP * 4
    return min(_CPU_DEFAULT_CAP, available // 4), "default budget: a quarter of the available RAM, at most 4 GiB"


def _kv_geometry(model: nn.Module) -> tuple[int, int, int]:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, _local_kv_heads(model, kv_heads), head_dim


def _local_kv_heads(model: nn.Module, kv_heads: int) -> int:
    """K/V heads this rank computes: a column-wise sharded ``k_proj`` (tensor parallelism) splits them."""
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


def _layer_devices(model: nn.Module, num_layers: int) -> tuple[torch.device, ...]:
    """The device each decoder layer computes on, so each pool sits next to its layer."""
    layers = get_attr_path(model, get_spec(model).layers)
    # accelerate: an offloaded layer's weights are on "meta"; it computes on its hook's execution device
    return tuple(execution_device(layer) or torch.device("cpu") for layer in list(layers)[:num_layers])


def pool_spec(model: nn.Module, block_size: int, num_blocks: int | None, max_memory: int | None) -> PoolSpec:
    """The pool for ``model``: ``num_blocks`` blocks, or as many as ``max_memory`` bytes hold (default budget: half
    the free GPU memory, or on CPU a quarter of the available RAM capped at 4 GiB).

    Raises:
        IncompatibleOptionsError: a bad ``block_size`` / ``num_blocks``, or a budget that holds no block.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise IncompatibleOptionsError(f"PagedCache.block_size must be an int >= 1, got {block_size!r}")
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
        raise IncompatibleOptionsError(f"PagedCache.num_blocks must be an int >= 1 or None, got {num_blocks!r}")
    num_layers, kv_heads, head_dim = _kv_geometry(model)
    dtype = model_dtype(model)
    devices = _layer_devices(model, num_layers)
    token_bytes = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    block_bytes = num_layers * block_size * token_bytes
    why = f"num_blocks={num_blocks}"
    if num_blocks is None:
        budget, why = (
            (max_memory, f"max_memory={max_memory} bytes") if max_memory is not None else _default_budget(devices[0])
        )
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise IncompatibleOptionsError(
                f"PagedCache.max_memory={budget} bytes holds no block: one block of {block_size} tokens over "
                f"{num_layers} layers takes {block_bytes} bytes"
            )
    return PoolSpec(num_layers, kv_heads, head_dim, dtype, devices, block_size, num_blocks, block_bytes, why)
