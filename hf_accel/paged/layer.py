"""One decoder layer's part of a :class:`~.cache.PagedCache`: its K and V pools, the checks on what the model
hands the cache, and the pool reads and writes the paged attention function does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin

from ..core.errors import IncompatibleOptionsError
from .blocks import BlockCopy
from .plan import StepPlan, context_slots

if TYPE_CHECKING:
    from .cache import PagedCache

__all__ = ["LAYER_TAG", "PAGED_ATTENTION_PREFIX", "PagedLayer", "Scoring", "uses_paged_attention"]

#: Attention implementations registered by hf_accel are named ``"hf_accel_paged:<base>"``.
PAGED_ATTENTION_PREFIX = "hf_accel_paged:"
#: Attribute set on the K tensor ``update`` returns: the :class:`PagedLayer` it belongs to.
LAYER_TAG = "_hf_accel_paged_layer"


def uses_paged_attention(model: nn.Module) -> bool:
    """Whether ``model`` currently runs hf_accel's paged attention (its ``_attn_implementation`` is a paged one)."""
    impl = getattr(model.config, "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith(PAGED_ATTENTION_PREFIX)


class PagedLayer(CacheLayerMixin):
    """One decoder layer's K/V pools. Sequence bookkeeping lives in the owning :class:`PagedCache`."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.device = device
        self.dtype = dtype
        # normal tensors even under torch.inference_mode(): the pools outlive the call and are written in place by
        # later ones, which may run outside it (an inference tensor refuses in-place updates there)
        with torch.inference_mode(False):
            self.keys = torch.empty(shape, dtype=dtype, device=device)  # [NB, BS, H_kv, D]; never read before written
            self.values = torch.empty(shape, dtype=dtype, device=device)
        self.zeroed = False  # pools zero-filled (and kept so as they grow): attention that reads whole blocks
        self.is_initialized = True
        self.pending = False  # K/V handed out by update() and not yet written by the attention function
        self.attention: Any = None  # how decode-sized chunks attend (a kernels.ops.Choice; set by the cache)

    def __repr__(self) -> str:
        return f"PagedLayer({self.layer_idx})"

    # --- CacheLayerMixin contract (sequence state is the cache's) ---
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Hand this layer's new K/V ([B, H_kv, Q, D]) to the paged attention function, tagged with the layer.

        Raises:
            IncompatibleOptionsError: the model does not run hf_accel's paged attention, K/V do not match the pool
                (another model, dtype or device), or the last K/V handed out never reached the attention function.
        """
        cache = self.cache
        impl = getattr(cache.config, "_attn_implementation", None) or ""
        if not impl.startswith(PAGED_ATTENTION_PREFIX):
            raise IncompatibleOptionsError(
                f"PagedCache needs hf_accel's paged attention, but the model's attention implementation is {impl!r}; "
                "patch the model first: hf_accel.patch_model(model) (the 'paged' feature)"
            )
        if key_states.shape[1] != cache.kv_heads or key_states.shape[-1] != cache.head_dim:
            raise IncompatibleOptionsError(
                f"PagedCache was built for K/V of {cache.kv_heads} heads x {cache.head_dim} dims, got "
                f"{tuple(key_states.shape)}: a PagedCache belongs to the model it was built for"
            )
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise IncompatibleOptionsError(
                f"PagedCache layer {self.layer_idx} holds {self.dtype} on {self.device}, but the model produced "
                f"{key_states.dtype} on {key_states.device}; build the cache after moving/casting the model"
            )
        if self.pending:
            raise IncompatibleOptionsError(
                f"layer {self.layer_idx}'s previous K/V never reached hf_accel's paged attention: the attention "
                "function of this architecture does not consume the cache's output; paged generation is unsupported"
            )
        self.pending = True
        setattr(key_states, LAYER_TAG, self)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # the pool keeps its storage; the cache drops the tables
        self.pending = False

    def offload(self) -> None:
        raise IncompatibleOptionsError("PagedCache does not support offloading; size the pool instead")

    def prefetch(self) -> None:
        return None

    def grow(self, num_blocks: int) -> None:
        """Reallocate the pools with ``num_blocks`` blocks, keeping the stored ones (between forwards only)."""
        old = self.keys.shape[0]
        shape = (num_blocks, *self.keys.shape[1:])
        new = torch.zeros if self.zeroed else torch.empty
        with torch.inference_mode(False):  # normal tensors, as in __init__
            keys = new(shape, dtype=self.dtype, device=self.device)  # [NB', BS, H_kv, D]
            values = new(shape, dtype=self.dtype, device=self.device)
            keys[:old].copy_(self.keys)
            values[:old].copy_(self.values)
        self.keys, self.values = keys, values

    def zero_fill(self) -> None:
        """Zero the pools, and allocate zeroed blocks from now on: for attention that reads a row's partial last block
        whole (FlexAttention), where a never-written slot must hold a finite value (a masked score times NaN is
        NaN). Called by the cache before anything is stored."""
        self.keys.zero_()
        self.values.zero_()
        self.zeroed = True

    # --- pool access ---
    def write(self, key: torch.Tensor, value: torch.Tensor, step: StepPlan) -> None:
        """Store the real tokens of this chunk. ``key``/``value``: [B, H_kv, Q, D]."""
        self.pending = False
        t = step.tensors(self.device)
        self.copy_blocks(step.copies)
        if t["slots"].numel() == 0:
            return
        k = key.transpose(1, 2).reshape(-1, *key.shape[1:2], key.shape[3])  # [B*Q, H_kv, D]
        v = value.transpose(1, 2).reshape(-1, *value.shape[1:2], value.shape[3])
        if not step.all_valid:
            k, v = k.index_select(0, t["valid_index"]), v.index_select(0, t["valid_index"])  # [N, H_kv, D]
        flat = (-1, *self.keys.shape[2:])
        self.keys.view(flat).index_copy_(0, t["slots"], k.to(self.dtype))
        self.values.view(flat).index_copy_(0, t["slots"], v.to(self.dtype))

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write of shared partial blocks: each copy's first tokens from ``src`` to ``dst``."""
        for c in copies:
            self.keys[c.dst, : c.num_tokens] = self.keys[c.src, : c.num_tokens]
            self.values[c.dst, : c.num_tokens] = self.values[c.src, : c.num_tokens]

    def context(self, row: int, step: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s whole stored context, gathered: ``[H_kv, S, D]`` each (dense path only)."""
        slots = context_slots(self.cache.manager, self.cache.tables, step, row).to(self.device)
        flat = (-1, *self.keys.shape[2:])
        k = self.keys.view(flat).index_select(0, slots).transpose(0, 1)
        v = self.values.view(flat).index_select(0, slots).transpose(0, 1)
        return k, v


@dataclass(frozen=True)
class Scoring:
    """How one attention call scores its keys: the arguments every paged-attention implementation takes after the
    positions (:func:`hf_accel.kernels.reference.paged_attention`), in that order (:attr:`args`).

    Args:
        scale: multiplies ``q . k``.
        window: sliding window in tokens (0: none).
        softcap: Gemma-2's ``softcap * tanh(score / softcap)`` (0: none).
        sinks: ``[H_q]`` attention-sink logits (GPT-OSS's ``s_aux``): one more logit in each head's softmax, reading
            no value; ``None``: none.
    """

    scale: float
    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @classmethod
    def of_call(cls, kwargs: dict[str, Any], scaling: float | None, head_dim: int) -> Scoring:
        """From an attention function's ``scaling`` and keyword arguments (``sliding_window``, ``softcap``,
        ``s_aux``)."""
        scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
        window, softcap = int(kwargs.get("sliding_window") or 0), float(kwargs.get("softcap") or 0.0)
        return cls(float(scale), window, softcap, kwargs.get("s_aux"))

    @property
    def args(self) -> tuple[float, int, float, torch.Tensor | None]:
        return self.scale, self.window, self.softcap, self.sinks
