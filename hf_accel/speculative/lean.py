"""A lean forward of short chunks for draft models of the Llama family (the draft's hot loop).

A draft model proposes one token per forward, and at SmolLM2's size most of such a forward is Transformers'
per-call work (mask building, keyword plumbing, hooks), not maths: ~22 ms per int8 draft step, of which the int8
linears are ~7 ms. :class:`LeanStep` runs the same layers' modules and weights directly over the same
``DynamicCache`` and ragged 2D mask: ~15 ms (docs/speculative.md); chunks of a few tokens (the draft's catch-ups
after a verification) likewise. It only ever serves a draft, whose tokens the
target verifies, so a numerical difference could cost acceptance but never change the output; the tests still
hold it to the model's own forward at a tight tolerance.

Covered: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (pre-norm decoder layers, rotary embeddings, optional
q/k norms) with full attention everywhere; :meth:`LeanStep.build` returns ``None`` for anything else (other
architectures, sliding-window layers, hooks or modules it does not recognise), and the draft then runs its
model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LeanStep"]

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Transformers' RMSNorm: normalise in fp32, cast back, scale by the weight. ``x [..., C]``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _is_rms_norm(module: Any) -> bool:
    return isinstance(module, nn.Module) and hasattr(module, "variance_epsilon") and hasattr(module, "weight")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the half-split convention of these models). ``x [B, H, C, D]``, ``cos/sin [B, 1, C, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanStep:
    """Forward of a short chunk of a supported causal LM over a ``DynamicCache`` (draft steps, catch-ups).

    Build it with :meth:`build`; call it with the step's tokens, its ragged layout and positions.
    """

    def __init__(self, model: nn.Module) -> None:
        base = model.model
        self.embed, self.rotary, self.norm, self.head = base.embed_tokens, base.rotary_emb, base.norm, model.lm_head
        self.layers = list(base.layers[: model.config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attn.head_dim

    @staticmethod
    def build(model: nn.Module) -> LeanStep | None:
        """A lean step for ``model``, or ``None`` where it does not apply (the model's own forward then runs)."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
            return None
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            return None
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            return None
        base = getattr(model, "model", None)
        if base is None or not all(hasattr(base, part) for part in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        if not _is_rms_norm(base.norm) or not isinstance(getattr(model, "lm_head", None), nn.Module):
            return None
        for layer in base.layers:
            if not all(hasattr(layer, part) for part in _LAYER_PARTS):
                return None
            attn = layer.self_attn
            if not all(hasattr(attn, part) for part in (*_ATTENTION_PARTS, "head_dim", "scaling", "layer_idx")):
                return None
            if not (_is_rms_norm(layer.input_layernorm) and _is_rms_norm(layer.post_attention_layernorm)):
                return None
        if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules()):
            return None  # hooks (accelerate offload, user hooks) must see the model's own forward
        return LeanStep(model)

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, last_only: bool = False
    ) -> torch.Tensor:
        """Run a short chunk (one token per row in a draft step; a few in a catch-up).

        Args:
            ids: ``[B, C]`` the chunk's tokens.
            mask: ``[B, T]`` the ragged layout including the chunk's columns (1 = real token; holes and padding 0).
            positions: ``[B, C]`` each token's index among its row's real tokens.
            cache: the ``DynamicCache`` holding the first ``T - C`` columns; the chunk's K/V are appended.
            last_only: only the last column's logits.

        Returns:
            ``[B, C, V]`` logits (``[B, 1, V]`` with ``last_only``).
        """
        batch, width = ids.shape
        mask, positions = mask.to(ids.device), positions.to(ids.device)  # the layout may live on the host
        total = mask.shape[1]
        h = self.embed(ids)  # [B, C, E]
        cos, sin = self.rotary(h, position_ids=positions)  # each [B, C, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, C, D]
        allowed = mask.bool()[:, None, None, :]  # [B, 1, 1, T]: every query sees its row's real tokens ...
        if width > 1:  # ... up to its own column
            causal = torch.ones(width, total, dtype=torch.bool, device=mask.device).tril(total - width)  # [C, T]
            allowed = allowed & causal
        groups = self.heads // self.kv_heads
        # the query heads of a group share one K/V head: fold them into the query axis (no K/V copy)
        allowed = allowed.repeat(1, 1, groups, 1) if width > 1 else allowed  # [B, 1, G*C, T]
        for layer in self.layers:
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, h)  # [B, C, E]
            q = attn.q_proj(x).view(batch, width, self.heads, self.head_dim)  # [B, C, H, D]
            k = attn.k_proj(x).view(batch, width, self.kv_heads, self.head_dim)  # [B, C, H_kv, D]
            v = attn.v_proj(x).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, C, D]
            if hasattr(attn, "q_norm"):  # qwen3: per-head norms before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = _rotate(q.transpose(1, 2), cos, sin)  # [B, H, C, D]
            k = _rotate(k.transpose(1, 2), cos, sin)  # [B, H_kv, C, D]
            keys, values = cache.update(k, v, attn.layer_idx)  # [B, H_kv, T, D]
            folded = q.reshape(batch, self.kv_heads, groups * width, self.head_dim)  # [B, H_kv, G*C, D]
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=allowed, scale=attn.scaling)
            out = out.view(batch, self.heads, width, self.head_dim).transpose(1, 2)  # [B, C, H, D]
            h = h + attn.o_proj(out.reshape(batch, width, self.heads * self.head_dim))
            h = h + layer.mlp(_rms_norm(layer.post_attention_layernorm, h))
        if last_only:
            h = h[:, -1:]
        return self.head(_rms_norm(self.norm, h))  # [B, C or 1, V]
