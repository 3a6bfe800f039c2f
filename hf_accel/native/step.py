"""A lean forward of a chunk of a Llama-family model over a ``DynamicCache``: the native executor's step.

At SmolLM2's size most of a one-token forward is Transformers' per-call work (mask building, keyword plumbing,
hooks), not maths: ~22 ms per int8 draft step, of which the int8 linears are ~7 ms. :class:`LeanStep` runs the
same modules and weights directly over the same cache and ragged 2D mask, and where :class:`~.layers.NativeLayers`
applies, all decoder layers in one native call. It serves speculative drafts (steps, catch-ups, guess checks),
speculative targets (verification chunks and prompts) and, with the ``native`` feature, plain decoding
(:mod:`.apply`). Its logits equal the model's forward up to float32 summation order (tested at 2e-5).

Covered: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (pre-norm decoder layers, rotary embeddings, optional q/k
norms) with full attention everywhere; :meth:`LeanStep.build` returns ``None`` for anything else (other
architectures, sliding-window layers, hooks or modules it does not recognise), and the model's own forward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.dispatch import is_tensor_parallel
from ..kernels.ops import choose
from ..kernels.reference import HALF_DTYPES, HALF_MAX_ROWS
from ..kernels.tuning import CPU
from ..quant.codes import Codes
from .coded import CODED_MAX_ROWS, CodeBook
from .layers import (
    PROMPT_MASK_CELLS,
    NativeLayers,
    has_hooks,
    is_rms_norm,
    paged_layers,
    weight_only_native,
)

__all__ = ["LEAN_MODEL_TYPES", "LeanStep"]

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "exaone")  # exaone: Llama's classes
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_HEAD_KERNEL_ROWS = CPU.int8_head_kernel_rows  # an int8 head runs the kernel up to this many rows


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Transformers' RMSNorm: normalise in fp32, cast back, scale by the weight. ``x [..., C]``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the half-split convention of these models). ``x [B, H, C, D]``, ``cos/sin [B, 1, C, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _half_head(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A bfloat16 / float16 ``nn.Linear`` head on float32 ``h [B, C, E]`` (a half model's native layers' output):
    few rows through ``half_linear`` (float32 sums), more through the half GEMM; float32 logits either way."""
    weight, bias = head.weight, head.bias
    flat = h.reshape(-1, h.shape[-1])  # [B*C, E]
    choice = choose("half_linear", "cpu", dtype=weight.dtype, in_features=weight.shape[1])
    if choice.native and flat.shape[0] <= HALF_MAX_ROWS:
        logits = choice.fn(flat.contiguous(), weight)  # [B*C, V] float32
        logits = logits if bias is None else logits + bias
    else:
        logits = F.linear(flat.to(weight.dtype), weight, bias)
    return logits.float().view(*h.shape[:-1], -1)  # float32 logits: the sums were float32 (F.linear: a prompt)


def _coded_head(head: nn.Module, h: torch.Tensor, codes: Codes) -> torch.Tensor:
    """A float32 head whose weight is exact codes, on few rows ``h [B, C, E]``: ``coded_linear``."""
    flat = h.reshape(-1, h.shape[-1]).contiguous()  # [B*C, E]
    if codes.bits == 16:  # float32 values that are all bfloat16 / float16 ones: widened exactly
        fn = choose("half_linear", "cpu", dtype=codes.codes.dtype, in_features=flat.shape[1]).fn
        logits = fn(flat, codes.codes)  # [B*C, V]
    else:
        logits = choose("coded_linear", "cpu").fn(flat, codes.codes, codes.params)  # [B*C, V]
    logits = logits if head.bias is None else logits + head.bias
    return logits.view(*h.shape[:-1], -1)


def _head(
    head: nn.Module, h: torch.Tensor, kernel: Callable[..., torch.Tensor] | None, codes: Codes | None = None
) -> torch.Tensor:
    """The LM head on ``h [B, C, E]``. A weight-only int8 head runs hf_accel's kernel for any row count (its module
    de-quantizes the whole weight above 16 rows, the right trade for a prompt, not for a draft's guess checks), or
    ``kernel`` (``w8a16_linear`` / ``w8a8_linear`` of the native layers' build, as the layers ran) where its
    weight suits it. A half-precision head on float32 states (a half model's native layers): :func:`_half_head`."""
    if codes is not None and h.dtype == torch.float32 and h.shape[0] * h.shape[1] <= CODED_MAX_ROWS:
        return _coded_head(head, h, codes)
    if h.dtype == torch.float32 and type(head) is nn.Linear and head.weight.dtype in HALF_DTYPES:
        return _half_head(head, h)
    if not (
        weight_only_native(head)
        and h.is_cpu
        and h.dtype == torch.float32
        and h.shape[0] * h.shape[1] <= _HEAD_KERNEL_ROWS
    ):
        return head(h)
    return head.kernel(h, kernel)  # [B, C, V]


class LeanStep:
    """Forward of a short chunk of a supported causal LM over a ``DynamicCache`` (draft steps, catch-ups).

    Build it with :meth:`build`; call it with the step's tokens, its ragged layout and positions.
    """

    def __init__(
        self,
        model: nn.Module,
        native: bool = True,
        kv_dtype: torch.dtype = torch.float16,
        codebook: CodeBook | None = None,
    ) -> None:
        base = model.model
        self.embed, self.rotary, self.norm, self.head = base.embed_tokens, base.rotary_emb, base.norm, model.lm_head
        self.layers = list(base.layers[: model.config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.native, why = NativeLayers.inspect(self) if native else (None, "native layers not asked for")
        #: why the layers run as modules rather than natively (``None`` when they run natively)
        self.why_not_native = why if self.native is None else None
        if self.native is not None:
            self.native.kv_dtype = kv_dtype
        #: the head's exact codes (:mod:`.coded`; ``None``: it has none, or no codebook was given)
        self.head_codes: Codes | None = None
        if codebook is not None and self.native is not None:
            self.native.use_codes(codebook)
            if self._float_head():
                self.head_codes = codebook.get(self.head.weight)
            codebook.keep_only(self.float_weights())  # forget the codes of weights it no longer reads

    def _float_head(self) -> bool:
        return type(self.head) is nn.Linear and self.head.weight.dtype == torch.float32 and self.head.weight.is_cpu

    def float_weights(self) -> list[torch.Tensor]:
        """The float32 weights the native layers and the head read, for which exact codes may stand in."""
        layers = [t for t in self.native.flat if t.dim() == 2 and t.dtype == torch.float32] if self.native else []
        return [*layers, *([self.head.weight] if self._float_head() else [])]

    def step_bytes(self) -> tuple[int, int]:
        """``(bytes, weights)``: what a one-row step of the native layers and the head reads (codes where it runs
        from them), and how many weights that is (an int8 copy would read about as many bytes)."""
        params = [t for t in (self.native.params(1) if self.native is not None else []) if t.dim() >= 2]
        head = self.head.weight
        count = sum(t.numel() * (2 if t.dtype == torch.uint8 else 1) for t in params if t.dim() == 2)  # 4-bit: 2/byte
        read = sum(t.numel() * t.element_size() for t in params)  # weights or codes, and the codes' (d, m) pairs
        read += self.head_codes.nbytes if self.head_codes is not None else head.numel() * head.element_size()
        return read, count + head.numel()

    def codes_stale(self) -> bool:
        """Whether a weight this step runs from exact codes changed since they were found (rebuild the step)."""
        if self.native is None or self.native.codebook is None:
            return False
        head = [self.head.weight] if self.head_codes is not None else []
        return self.native.codebook.stale([*self.native.coded_weights, *head])

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why a lean step cannot serve ``model`` (``None``: it can)."""
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in LEAN_MODEL_TYPES:
            return f"model_type {model_type!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            return "some layers are not full attention"
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            return "sliding-window attention"
        base = getattr(model, "model", None)
        if base is None or not all(hasattr(base, part) for part in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return "the decoder lacks embed_tokens / rotary_emb / norm / layers"
        if not is_rms_norm(base.norm) or not isinstance(getattr(model, "lm_head", None), nn.Module):
            return "the final norm is not an RMSNorm, or there is no lm_head module"
        for layer in base.layers:
            attn = getattr(layer, "self_attn", None)
            if not all(hasattr(layer, part) for part in _LAYER_PARTS) or not all(
                hasattr(attn, part) for part in (*_ATTENTION_PARTS, "head_dim", "scaling", "layer_idx")
            ):
                return "a decoder layer's modules are not the Llama family's"
            if not (is_rms_norm(layer.input_layernorm) and is_rms_norm(layer.post_attention_layernorm)):
                return "a decoder layer's norms are not RMSNorms"
        if has_hooks(model.modules()):
            return "forward hooks (accelerate's or a user's) must see the model's own forward"
        if is_tensor_parallel(model):
            return "tensor-parallel shards: the model's own forward does the collectives"
        return None

    @staticmethod
    def exact(model: nn.Module, half: bool = False, codebook: CodeBook | None = None) -> LeanStep | None:
        """A step that runs ``model``'s own maths (float32 K/V; int8 projections weight-only, as its ``Int8Linear``
        layers compute them, never W8A16 / W8A8; W8A8 ones W8A8): a target's, or the ``native`` feature's plain
        decoding. ``None`` where no native layers apply (:meth:`unsupported` / :attr:`why_not_native` say why), and
        for half-precision weights unless ``half`` (the ``native`` feature asked of a half model: float32 activations
        are not the half model's own rounding). With ``codebook``, float32 weights that are exact codes run from them
        in narrow chunks (:mod:`.coded`): the same weights, fewer bytes."""
        step = LeanStep.build(model, kv_dtype=torch.float32, codebook=codebook)
        if step is None or step.native is None or (step.native.half is not None and not half):
            return None
        step.native.w8a16 = step.native.w8a8 = False
        return step

    @staticmethod
    def build(
        model: nn.Module, native: bool = True, kv_dtype: torch.dtype = torch.float16, codebook: CodeBook | None = None
    ) -> LeanStep | None:
        """A lean step for ``model``, or ``None`` where it does not apply (:meth:`unsupported` says why; the model's
        own forward then runs).

        Args:
            model: the draft (or a speculative target's verification chunks: then ``kv_dtype=torch.float32``).
            native: run the layers natively where :class:`NativeLayers` applies (``False``: always the modules).
            kv_dtype: dtype of the K/V the native layers keep (:attr:`NativeLayers.kv_dtype`).
            codebook: run float32 weights that are exact codes from them (:mod:`.coded`).
        """
        return None if LeanStep.unsupported(model) is not None else LeanStep(model, native, kv_dtype, codebook)

    def takes_prompt(self, cache: Any, cells: int) -> bool:
        """Whether a prompt over ``cache`` may run here rather than through the model's forward: native layers with
        float projections only (a target; an int8 draft's prompt keeps its modules' weight-only maths) that serve
        ``cache``, and a mask of ``cells`` = rows x prompt tokens x columns of at most ``PROMPT_MASK_CELLS`` (the
        native call takes the mask as a boolean tensor; a longer prompt runs the model's forward, whose attention
        need not build one); W8A8 projections run their own kernel at any width, so a W8A8 model's prompt runs here
        too. Wide chunks run PyTorch's fused attention inside the native call, and the norms,
        rotations and SiLU-gated products are fused passes instead of ~10 elementwise operators a layer (one-off:
        ~0.3 s of the forward of four 447-token prompts through SmolLM2, a fifth of it, went to those operators)."""
        fits = cells <= PROMPT_MASK_CELLS
        own_maths = self.native is not None and (self.native.float_only or self.native.int8_activations)
        return fits and own_maths and self.native.serves(cache)

    def __call__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        last: int = 0,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Run a chunk: one token per row in a draft step, a few in a catch-up or a verification, or a prompt
        (where :meth:`takes_prompt`).

        Args:
            ids: ``[B, C]`` the chunk's tokens.
            mask: ``[B, T]`` the ragged layout including the chunk's columns (1 = real token; holes and padding 0).
            positions: ``[B, C]`` each token's index among its row's real tokens.
            cache: the ``DynamicCache`` holding the first ``T - C`` columns; the chunk's K/V are appended.
            last: only the last ``last`` columns' logits (0: every column's).
            hidden: return the final hidden states (after the last norm) instead of logits.

        Returns:
            ``[B, C, V]`` logits (``[B, min(C, last), V]`` with ``last``); with ``hidden``, ``[B, C or last, E]``.
        """
        batch, width = ids.shape
        mask, positions = mask.to(ids.device), positions.to(ids.device)  # the layout may live on the host
        total = mask.shape[1]
        native = self.native is not None and self.native.serves(cache)
        h = self.embed(ids)  # [B, C, E]
        if native and self.native.half is not None:
            h = h.float()  # a half model's native layers keep float32 hidden states (and rotations)
        cos, sin = self.rotary(h, position_ids=positions)  # each [B, C, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, C, D]
        allowed = mask.bool()[:, None, None, :]  # [B, 1, 1, T]: every query sees its row's real tokens ...
        if width > 1:  # ... up to its own column
            causal = torch.ones(width, total, dtype=torch.bool, device=mask.device).tril(total - width)  # [C, T]
            allowed = allowed & causal
        mode = None
        if native:
            allowed = allowed[:, 0].expand(batch, width, total)  # [B, C, T]
            mode = self.native.mode(batch * width, width)
            h = self.native(h, cos[:, 0], sin[:, 0], allowed, cache, mode)
        else:
            h = self._layers(h, cos, sin, allowed, cache)
        if last:
            h = h[:, -last:]
        if hidden:
            return _rms_norm(self.norm, h).to(self.norm.weight.dtype)  # [B, C or last, E] in the model's dtype
        kernel = None if mode is None else self.native.head_kernel(mode, self.head, h.shape[0] * h.shape[1])
        return _head(self.head, _rms_norm(self.norm, h), kernel, self.head_codes)  # [B, C or last, V]

    def paged_hidden(self, ids: torch.Tensor, positions: torch.Tensor, pools: Any, plan: Any) -> tuple[Any, int]:
        """A chunk's last hidden states over a paged pool, before the final norm: ``ids`` / ``positions`` ``[B, C]``,
        ``pools`` the cache's layers, ``plan`` ``(slots, block_tables, q_pos)`` (:func:`~.layers.paged_layers`; the
        caller checked :attr:`NativeLayers.paged_fn` and the pool). Returns ``([B, C, E], the int8 mode it ran)``."""
        h = self.embed(ids)  # [B, C, E]
        cos, sin = self.rotary(h, position_ids=positions.clamp_min(0))  # each [B, C, D]
        mode = self.native.mode(ids.numel(), ids.shape[1])
        return paged_layers(self.native, h, cos, sin, pools, plan, mode), mode

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The model's last norm on hidden states ``[..., E]`` (what ``model.model`` returns)."""
        return _rms_norm(self.norm, h)

    def logits(self, h: torch.Tensor, mode: int) -> torch.Tensor:
        """The final norm and the LM head on hidden states ``[B, C, E]`` from a chunk run with ``mode``."""
        kernel = None if self.native is None else self.native.head_kernel(mode, self.head, h.shape[0] * h.shape[1])
        return _head(self.head, _rms_norm(self.norm, h), kernel, self.head_codes)  # [B, C, V]

    def _layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """The layers' own modules: ``h [B, C, E]``, ``cos / sin [B, 1, C, D]``, ``allowed [B, 1, C or 1, T]``."""
        batch, width = h.shape[:2]
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
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, C, D], [B, H_kv, C, D]
            if getattr(attn, "use_rope", True):  # SmolLM3's NoPE layers have none
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.update(k, v, attn.layer_idx)  # [B, H_kv, T, D]
            folded = q.reshape(batch, self.kv_heads, groups * width, self.head_dim)  # [B, H_kv, G*C, D]
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=allowed, scale=attn.scaling)
            out = out.view(batch, self.heads, width, self.head_dim).transpose(1, 2)  # [B, C, H, D]
            h = h + attn.o_proj(out.reshape(batch, width, self.heads * self.head_dim))
            h = h + layer.mlp(_rms_norm(layer.post_attention_layernorm, h))
        return h
