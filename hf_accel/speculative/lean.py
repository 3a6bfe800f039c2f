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

Native path (:class:`NativeLayers`, ``csrc/lean_layers.cpp``): on a CPU with AVX2 (or AVX-512), a float32 draft
whose projections are ``nn.Linear`` or weight-only ``Int8Linear``, SiLU-gated MLPs, one RMSNorm epsilon and a
cache of :class:`~.growing.GrowingLayer` layers, all decoder layers of a step run in one native call (the per-layer
Python and dispatcher work, ~250 us a layer, is most of an int8 draft step otherwise). Anything else runs the
modules as below. A speculative target uses the same path for its verification chunks and, with float projections
only, for its prompt (:meth:`LeanStep.takes_prompt`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from .._ext import load_extension
from ..core.dispatch import is_tensor_parallel
from ..quant.linear import w8a8_fits
from .growing import GrowingLayer

__all__ = ["LeanStep", "NativeLayers", "native_module"]

_SOURCE = Path(__file__).with_name("csrc") / "lean_layers.cpp"
#: the native layers' builds, widest first: (instruction set, extension name, int8 group size multiple it needs)
_BUILDS = (("avx512vnni", "lean_layers_vnni", 16), ("avx512", "lean_layers_avx512", 16), ("avx2", "lean_layers", 8))

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
#: Up to this many rows an int8 draft head runs the kernel (one-off timing on SmolLM2's 49152x576 head: ~0.45 ms a
#: row, against ~80 ms to de-quantize the weight for a GEMM)
_HEAD_KERNEL_ROWS = 128
#: From this chunk width (a draft's prompt-lookup guess check) a native int8 draft chunk runs W8A8 where it can (VNNI
#: build): int8 activations halve W8A16's integer work again there. Narrower chunks (steps, catch-ups) run W8A16, whose
#: int16 activations keep the int8 weights' own accuracy (a fully W8A8 draft accepted measurably less; one-off timings
#: in docs/speculative.md)
W8A8_MIN_WIDTH = 6
#: From this many activation rows (batch x chunk width) the int8 projections run W8A16 where they can (VNNI build):
#: one row streams the weights at memory speed either way, and the weight-only kernel skips quantizing it (one-off,
#: SmolLM2's 30 layers with distinct int8 weights, ms at 1 / 2 / 4 rows: weight-only 4.4 / 6.8 / 7.4, W8A16
#: 4.8 / 4.9 / 6.4; the head 0.68 / 1.37 / 1.41 against 0.83 / 0.74 / 0.83)
W8A16_MIN_ROWS = 2
#: Largest prompt mask (rows x prompt tokens x columns, one byte each) the native layers take (64 MiB: a batch of 4
#: prompts of 4096 tokens)
PROMPT_MASK_CELLS = 1 << 26
#: How the native layers run the int8 projections (``csrc/lean_layers.cpp``'s ``Mode``)
WEIGHT_ONLY, W8A16, W8A8 = 0, 1, 2


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Transformers' RMSNorm: normalise in fp32, cast back, scale by the weight. ``x [..., C]``."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def has_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` carries forward (pre-)hooks or an accelerate hook: those must see the model's own
    forward, so the lean paths stay off."""
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in modules)


def _is_rms_norm(module: Any) -> bool:
    return isinstance(module, nn.Module) and hasattr(module, "variance_epsilon") and hasattr(module, "weight")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the half-split convention of these models). ``x [B, H, C, D]``, ``cos/sin [B, 1, C, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def native_module(groups: set[int], isa: str | None = None) -> ModuleType | None:
    """The native layers built for this CPU and these int8 group sizes, or ``None``.

    Args:
        groups: the int8 projections' group sizes (AVX-512 needs multiples of 16, AVX2 of 8).
        isa: ``"avx512vnni"`` (AVX-512 + VNNI: can also run W8A8), ``"avx512"`` or ``"avx2"`` for that build only;
            ``None``: the widest that fits.
    """
    for build, name, lanes in _BUILDS:
        if isa in (None, build) and all(g % lanes == 0 for g in groups):
            module = load_extension(name, _SOURCE, build)
            if module is not None or isa == build:
                return module
    return None


def _head(head: nn.Module, h: torch.Tensor, kernel: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """The LM head on ``h [B, C, E]``. A weight-only int8 head runs hf_accel's kernel for any row count (its module
    de-quantizes the whole weight above 16 rows, the right trade for a prompt, not for a draft's guess checks), or
    ``kernel`` (``w8a16_linear`` / ``w8a8_linear`` of the native layers' VNNI build, as the layers ran) where its
    weight suits it."""
    if not (
        _weight_only_native(head)
        and h.is_cpu
        and h.dtype == torch.float32
        and h.shape[0] * h.shape[1] <= _HEAD_KERNEL_ROWS
    ):
        return head(h)
    return head.kernel(h, kernel)  # [B, C, V]


def _weight_only_native(module: Any) -> bool:
    """Whether ``module`` is a weight-only ``Int8Linear`` with a native CPU kernel."""
    from ..quant import Int8Linear

    return isinstance(module, Int8Linear) and module.activations == "float" and module._cpu_kernel == "native"


def _absent() -> torch.Tensor:
    return torch.empty(0)


def _projection(module: Any, groups: set[int]) -> list[torch.Tensor] | None:
    """``[weight, int8 scales or empty, bias or empty]`` of a float32 ``nn.Linear`` or a weight-only
    ``Int8Linear`` with a native kernel (its group size added to ``groups``); ``None`` for anything else."""
    bias = getattr(module, "bias", None)
    bias = _absent() if bias is None else bias.detach()
    if type(module) is nn.Linear and module.weight.dtype == torch.float32 and bias.dtype == torch.float32:
        return [module.weight.detach(), _absent(), bias]
    if _weight_only_native(module):
        if bias.numel() and bias.dtype != torch.float32:
            return None
        qweight, scale = module.qweight, module.scale  # [N, K] int8, [N, G] float32
        groups.add(qweight.shape[1] // scale.shape[1])
        return [qweight, scale, bias]
    return None


def _mlp(mlp: nn.Module, groups: set[int]) -> list[torch.Tensor] | None:
    """``gate`` (or the fused ``[gate; up]``), ``up`` (or absent) and ``down`` projections of a SiLU-gated MLP."""
    from ..fused.mlp import FusedGatedMLP

    if not isinstance(getattr(mlp, "act_fn", None), (nn.SiLU, SiLUActivation)) or not hasattr(mlp, "down_proj"):
        return None
    up: list[torch.Tensor] | None = [_absent()] * 3
    fused = getattr(mlp, "gate_up_proj", None) if isinstance(mlp, FusedGatedMLP) else None
    if fused is not None and not (type(fused) is nn.Linear or hasattr(fused, "dense_weight")):
        gate = _projection(fused, groups)  # an int8 fused projection (a self-speculative draft's)
    elif fused is not None:
        bias = mlp.gate_up_bias
        weight = mlp.gate_up_weight.detach()
        gate = None if weight.dtype != torch.float32 else [weight, _absent(), _absent() if bias is None else bias]
    elif hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
        gate, up = _projection(mlp.gate_proj, groups), _projection(mlp.up_proj, groups)
    else:
        return None
    down = _projection(mlp.down_proj, groups)
    if gate is None or up is None or down is None:
        return None
    return [*gate, *up, *down]


class NativeLayers:
    """Every decoder layer of a draft step in one native call (``csrc/lean_layers.cpp``).

    Build it with :meth:`build` (``None`` where it does not apply); :meth:`serves` tells whether a cache suits it.
    """

    def __init__(
        self, module: ModuleType, params: list[list[torch.Tensor]], eps: float, scaling: float, kv: tuple[int, int, int]
    ) -> None:
        self.module, self.params, self.eps, self.scaling = module, params, eps, scaling
        self.heads, self.kv_heads, self.head_dim = kv
        int8 = [(w, s) for layer in params for w, s in itertools.pairwise(layer) if w.dtype == torch.int8]
        #: every projection is float (a target, a float draft): prompts may run here too (:meth:`LeanStep.takes_prompt`)
        self.float_only = not int8
        #: the int8 projections can run W8A16 (VNNI build; a projection whose weight does not suit it runs
        #: weight-only) and W8A8 (VNNI build, one scale per weight row and in_features % 64 == 0 everywhere)
        self.w8a16 = bool(int8) and module.vnni()
        self.w8a8 = self.w8a16 and all(w8a8_fits(w, s) for w, s in int8)
        #: dtype of the K/V the native steps keep in the cache's growing layers: float16 halves what a step streams
        #: (at a batch of 4 rows and a ~450-token context the fp32 K/V of SmolLM2's 30 layers are ~80 MB, close to
        #: its int8 weights); the draft only proposes, so its keys' rounding can cost acceptance, never output
        self.kv_dtype = torch.float16

    def mode(self, rows: int, width: int) -> int:
        """How a chunk of ``rows`` activation rows (batch x width), ``width`` tokens wide, runs the int8
        projections: ``W8A8`` from ``W8A8_MIN_WIDTH`` tokens where possible, else ``W8A16`` from
        ``W8A16_MIN_ROWS`` rows where possible, else ``WEIGHT_ONLY``."""
        if self.w8a8 and width >= W8A8_MIN_WIDTH:
            return W8A8
        return W8A16 if self.w8a16 and rows >= W8A16_MIN_ROWS else WEIGHT_ONLY

    def head_kernel(self, mode: int, head: nn.Module, rows: int) -> Callable[..., torch.Tensor] | None:
        """The VNNI kernel the int8 ``head`` runs with on ``rows`` rows for a chunk whose layers ran ``mode``
        (``None``: the weight-only kernel)."""
        if mode == WEIGHT_ONLY or not _weight_only_native(head):
            return None
        weight, scale = head.qweight, head.scale
        if mode == W8A8 and w8a8_fits(weight, scale):
            return self.module.w8a8_linear
        if rows >= W8A16_MIN_ROWS and self.module.w8a16_fits(weight.shape[1], scale.shape[1]):
            return self.module.w8a16_linear
        return None

    @staticmethod
    def build(step: LeanStep) -> NativeLayers | None:
        """The native layers of ``step``'s model, or ``None`` (not float32 on the CPU, a projection or MLP it does
        not know, differing norm epsilons, no kernel for this CPU)."""
        norms = [step.norm]
        groups: set[int] = set()
        params = []
        scaling = step.layers[0].self_attn.scaling
        for layer in step.layers:
            attn = layer.self_attn
            if attn.scaling != scaling:
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            parts = [_projection(getattr(attn, name), groups) for name in _ATTENTION_PARTS]
            mlp = _mlp(layer.mlp, groups)
            if mlp is None or any(part is None for part in parts):
                return None
            head_norms = [_absent(), _absent()]
            if hasattr(attn, "q_norm"):
                if not (_is_rms_norm(attn.q_norm) and _is_rms_norm(attn.k_norm)):
                    return None
                norms += [attn.q_norm, attn.k_norm]
                head_norms = [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()]
            ln = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            params.append([*ln, *[t for part in parts for t in part], *mlp, *head_norms])  # csrc order
        if len({norm.variance_epsilon for norm in norms}) != 1:
            return None
        tensors = [t for layer in params for t in layer if t.numel()]
        if any(t.device.type != "cpu" or t.dtype not in (torch.float32, torch.int8) for t in tensors):
            return None
        module = native_module(groups)
        if module is None:
            return None
        kv = (step.heads, step.kv_heads, step.head_dim)
        return NativeLayers(module, params, float(step.norm.variance_epsilon), float(scaling), kv)

    def serves(self, cache: Any) -> bool:
        """Whether ``cache`` is one growing layer per decoder layer (the native call writes into its buffers)."""
        layers = getattr(cache, "layers", None)
        return (
            layers is not None
            and len(layers) == len(self.params)
            and all(type(layer) is GrowingLayer for layer in layers)
            and len({layer.get_seq_length() for layer in layers}) == 1
        )

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor, cache: Any, mode: int
    ) -> torch.Tensor:
        """Run every layer on ``h [B, C, E]``; ``cos / sin [B, C, D]``, ``allowed [B, C, T]`` bool; ``mode``: how the
        int8 projections run (``WEIGHT_ONLY``, or ``W8A16`` / ``W8A8`` where :attr:`w8a16` / :attr:`w8a8`).
        Appends the chunk's K/V to ``cache``; returns ``[B, C, E]``."""
        batch, width, hidden = h.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        reserved = [layer.reserve(batch, kv_heads, width, dim, self.kv_dtype, h.device) for layer in cache.layers]
        used = reserved[0][2]
        out = self.module.layers(
            h.reshape(batch * width, hidden),
            self.params,
            [r[0] for r in reserved],
            [r[1] for r in reserved],
            used,
            allowed.contiguous(),
            cos.reshape(batch * width, dim),
            sin.reshape(batch * width, dim),
            heads,
            kv_heads,
            self.eps,
            self.scaling,
            mode,
        )  # [B*C, E]
        for layer in cache.layers:
            layer.commit(used + width)
        return out.view(batch, width, hidden)


class LeanStep:
    """Forward of a short chunk of a supported causal LM over a ``DynamicCache`` (draft steps, catch-ups).

    Build it with :meth:`build`; call it with the step's tokens, its ragged layout and positions.
    """

    def __init__(self, model: nn.Module, native: bool = True, kv_dtype: torch.dtype = torch.float16) -> None:
        base = model.model
        self.embed, self.rotary, self.norm, self.head = base.embed_tokens, base.rotary_emb, base.norm, model.lm_head
        self.layers = list(base.layers[: model.config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.native = NativeLayers.build(self) if native else None
        if self.native is not None:
            self.native.kv_dtype = kv_dtype

    @staticmethod
    def build(model: nn.Module, native: bool = True, kv_dtype: torch.dtype = torch.float16) -> LeanStep | None:
        """A lean step for ``model``, or ``None`` where it does not apply (the model's own forward then runs).

        Args:
            model: the draft (or a speculative target's verification chunks: then ``kv_dtype=torch.float32``).
            native: run the layers natively where :class:`NativeLayers` applies (``False``: always the modules).
            kv_dtype: dtype of the K/V the native layers keep (:attr:`NativeLayers.kv_dtype`).
        """
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
        if has_hooks(model.modules()):
            return None  # hooks (accelerate offload, user hooks) must see the model's own forward
        if is_tensor_parallel(model):
            return None  # tensor-parallel shards: the model's own forward does the collectives
        return LeanStep(model, native, kv_dtype)

    def takes_prompt(self, cache: Any, cells: int) -> bool:
        """Whether a prompt over ``cache`` may run here rather than through the model's forward: native layers with
        float projections only (a target; an int8 draft's prompt keeps its modules' weight-only maths) that serve
        ``cache``, and a mask of ``cells`` = rows x prompt tokens x columns of at most ``PROMPT_MASK_CELLS`` (the
        native call takes the mask as a boolean tensor; a longer prompt runs the model's forward, whose attention
        need not build one). Wide chunks run PyTorch's fused attention inside the native call, and the norms,
        rotations and SiLU-gated products are fused passes instead of ~10 elementwise operators a layer (one-off:
        ~0.3 s of the forward of four 447-token prompts through SmolLM2, a fifth of it, went to those operators)."""
        fits = cells <= PROMPT_MASK_CELLS
        return fits and self.native is not None and self.native.float_only and self.native.serves(cache)

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
        h = self.embed(ids)  # [B, C, E]
        cos, sin = self.rotary(h, position_ids=positions)  # each [B, C, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, C, D]
        allowed = mask.bool()[:, None, None, :]  # [B, 1, 1, T]: every query sees its row's real tokens ...
        if width > 1:  # ... up to its own column
            causal = torch.ones(width, total, dtype=torch.bool, device=mask.device).tril(total - width)  # [C, T]
            allowed = allowed & causal
        mode = None
        if self.native is not None and self.native.serves(cache):
            allowed = allowed[:, 0].expand(batch, width, total)  # [B, C, T]
            mode = self.native.mode(batch * width, width)
            h = self.native(h, cos[:, 0], sin[:, 0], allowed, cache, mode)
        else:
            h = self._layers(h, cos, sin, allowed, cache)
        if last:
            h = h[:, -last:]
        if hidden:
            return _rms_norm(self.norm, h)  # [B, C or last, E]
        kernel = None if mode is None else self.native.head_kernel(mode, self.head, h.shape[0] * h.shape[1])
        return _head(self.head, _rms_norm(self.norm, h), kernel)  # [B, C or last, V]

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
            q = _rotate(q.transpose(1, 2), cos, sin)  # [B, H, C, D]
            k = _rotate(k.transpose(1, 2), cos, sin)  # [B, H_kv, C, D]
            keys, values = cache.update(k, v, attn.layer_idx)  # [B, H_kv, T, D]
            folded = q.reshape(batch, self.kv_heads, groups * width, self.head_dim)  # [B, H_kv, G*C, D]
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=allowed, scale=attn.scaling)
            out = out.view(batch, self.heads, width, self.head_dim).transpose(1, 2)  # [B, C, H, D]
            h = h + attn.o_proj(out.reshape(batch, width, self.heads * self.head_dim))
            h = h + layer.mlp(_rms_norm(layer.post_attention_layernorm, h))
        return h
