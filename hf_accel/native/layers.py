"""Every decoder layer of a Llama-family step in one native call: the native executor's layers.

:class:`NativeLayers` reads a model's decoder layers (RMSNorms, q/k/v/o projections, optional q/k head norms, a
SiLU-gated MLP) into the flat parameter list of the ``decoder_layers`` op (:mod:`hf_accel.kernels.ops`; the C++ is
``kernels/cpu/decoder_layers.cpp``, the pure-torch reference :func:`hf_accel.kernels.reference.decoder_layers`) and
runs a chunk through all of them over a cache of :class:`~.growing.GrowingLayer` layers: the per-layer Python and
dispatcher work (~250 us a layer at SmolLM2's size) disappears. Projections may be float32 ``nn.Linear`` or
weight-only ``Int8Linear``; int8 projections can also run with int16 (W8A16) or int8 (W8A8) activations and integer
dot products (:meth:`NativeLayers.mode`; AVX-512 VNNI's ``vpdpbusd`` / ``vpdpwssd`` in the VNNI build, AVX2's
``vpmaddubsw`` / ``vpmaddwd`` in the others).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation

from ..fused.mlp import FusedGatedMLP
from ..kernels.ops import Choice, choose, native_builds
from ..kernels.reference import HALF_DTYPES, LAYER_PARAMS, W8A8, W8A16, WEIGHT_ONLY, w8a16_fits
from ..kernels.tuning import CPU
from ..quant.linear import Int8Linear, w8a8_fits
from .coded import CODED_MAX_ROWS, CodeBook
from .growing import GrowingLayer

__all__ = [
    "PROMPT_MASK_CELLS",
    "W8A8",
    "W8A8_MIN_WIDTH",
    "W8A16",
    "W8A16_MIN_ROWS",
    "WEIGHT_ONLY",
    "NativeLayers",
    "has_hooks",
    "is_rms_norm",
    "layers_choice",
    "paged_layers",
    "weight_only_native",
]

_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
#: From this chunk width a native int8 chunk runs W8A8, and from this many activation rows W8A16, where they can
#: (every build); the largest prompt mask the native layers take (:mod:`hf_accel.kernels.tuning` says why)
W8A8_MIN_WIDTH = CPU.w8a8_min_width
W8A16_MIN_ROWS = CPU.w8a16_min_rows
PROMPT_MASK_CELLS = CPU.prompt_mask_cells
#: float weight dtypes the native layers read in place: float32, and a half-precision model's bfloat16 / float16
#: (products widened to float32 in registers for few rows, the half GEMM for a prompt; activations stay float32)
_FLOAT_DTYPES = (torch.float32, *HALF_DTYPES)
#: where each projection's weight sits among a layer's parameters (its scales and bias follow it)
_PROJECTION_AT = tuple(LAYER_PARAMS.index(name) for name in ("q", "k", "v", "o", "gate", "up", "down"))
#: the int8 group-size multiple each build's layers need (their weight-only int8 kernel's lanes)
_LANES = {"avx512vnni": 16, "avx512": 16, "avx2": 8}


def has_hooks(modules: Iterable[nn.Module]) -> bool:
    """Whether any of ``modules`` carries forward (pre-)hooks or an accelerate hook: those must see the model's own
    forward, so the lean paths stay off."""
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in modules)


def is_rms_norm(module: Any) -> bool:
    return isinstance(module, nn.Module) and hasattr(module, "variance_epsilon") and hasattr(module, "weight")


def weight_only_native(module: Any) -> bool:
    """Whether ``module`` is a weight-only ``Int8Linear`` with a native CPU kernel."""
    return isinstance(module, Int8Linear) and module.activations == "float" and module.cpu_native


def _int8_native(module: Any) -> bool:
    """Whether ``module`` is an ``Int8Linear`` (weight-only or W8A8) whose own maths is a native CPU kernel."""
    return isinstance(module, Int8Linear) and module.cpu_native


def _absent() -> torch.Tensor:
    return torch.empty(0)


def _projection(module: Any, groups: set[int], acts: set[str]) -> list[torch.Tensor] | None:
    """``[weight, int8 scales or empty, bias or empty]`` of a float32 ``nn.Linear`` or an ``Int8Linear`` with a
    native kernel (its group size added to ``groups``, its activations, ``"float"`` or ``"int8"``, to ``acts``);
    ``None`` for anything else."""
    bias = getattr(module, "bias", None)
    bias = _absent() if bias is None else bias.detach()
    if type(module) is nn.Linear and module.weight.dtype in _FLOAT_DTYPES and bias.dtype in _FLOAT_DTYPES:
        return [module.weight.detach(), _absent(), bias]  # float32, or bfloat16 / float16 read in place
    if _int8_native(module):
        if bias.numel() and bias.dtype != torch.float32:
            return None
        qweight, scale = module.qweight, module.scale  # [N, K] int8, [N, G] float32
        groups.add(qweight.shape[1] // scale.shape[1])
        acts.add(module.activations)
        return [qweight, scale, bias]
    return None


def _mlp(mlp: nn.Module, groups: set[int], acts: set[str]) -> list[torch.Tensor] | None:
    """``gate`` (or the fused ``[gate; up]``), ``up`` (or absent) and ``down`` projections of a SiLU-gated MLP."""
    if not isinstance(getattr(mlp, "act_fn", None), (nn.SiLU, SiLUActivation)) or not hasattr(mlp, "down_proj"):
        return None
    up: list[torch.Tensor] | None = [_absent()] * 3
    fused = getattr(mlp, "gate_up_proj", None) if isinstance(mlp, FusedGatedMLP) else None
    if fused is not None and not (type(fused) is nn.Linear or hasattr(fused, "dense_weight")):
        gate = _projection(fused, groups, acts)  # an int8 fused projection (a self-speculative draft's)
    elif fused is not None:
        bias = mlp.gate_up_bias
        weight = mlp.gate_up_weight.detach()
        gate = None if weight.dtype not in _FLOAT_DTYPES else [weight, _absent(), _absent() if bias is None else bias]
    elif hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
        gate, up = _projection(mlp.gate_proj, groups, acts), _projection(mlp.up_proj, groups, acts)
    else:
        return None
    down = _projection(mlp.down_proj, groups, acts)
    if gate is None or up is None or down is None:
        return None
    return [*gate, *up, *down]


def layers_choice(groups: set[int], isa: str | None = None) -> Choice | None:
    """The ``decoder_layers`` implementation for int8 projections in these group sizes: the widest native build that
    takes them (:func:`hf_accel.kernels.ops.choose`), or with ``isa`` that build only; ``None`` where none does (the
    layers' own modules run then)."""
    group = next((g for g in sorted(groups) if g % 16), None) or next(iter(sorted(groups)), None)
    choice = choose("decoder_layers", "cpu", group_size=group)
    if isa is not None:
        fn = native_builds("decoder_layers").get(isa)
        fits = fn is not None and all(g % _LANES[isa] == 0 for g in groups)
        return Choice("decoder_layers", f"cpu/{isa}", fn, "asked for", {}) if fits else None
    return choice if choice.native else None


def choose_layers_reasons(groups: set[int]) -> dict[str, str]:
    """Why each build of ``decoder_layers`` does not take int8 projections in these group sizes."""
    group = next((g for g in sorted(groups) if g % 16), None) or next(iter(sorted(groups)), None)
    return choose("decoder_layers", "cpu", group_size=group).rejected


class NativeLayers:
    """Every decoder layer of a step in one native call (``decoder_layers``, :mod:`hf_accel.kernels.ops`).

    Build it with :meth:`build` (``None`` where it does not apply); :meth:`serves` tells whether a cache suits it.
    """

    def __init__(
        self,
        choice: Choice,
        params: list[list[torch.Tensor]],
        eps: float,
        scaling: float,
        kv: tuple[int, int, int],
        rope: list[bool] | None = None,
    ) -> None:
        self.choice, self.eps, self.scaling = choice, eps, scaling
        self.flat = [t for layer in params for t in layer]  # LAYER_PARAMS tensors per layer
        #: runs of consecutive layers ``(start, stop, rotated)``, one call each: a layer without a rotary embedding
        #: (SmolLM3's NoPE layers) runs with identity tables (cos 1, sin 0: the rotation returns its input exactly)
        self.runs = _runs(rope if rope is not None else [True] * len(params))
        #: the model's float weights are bfloat16 / float16 (``None``: float32): the layers take and return float32
        #: hidden states all the same (:class:`~.step.LeanStep` converts at the embedding and the head)
        self.half: torch.dtype | None = next((t.dtype for t in self.flat if t.dtype in HALF_DTYPES), None)
        #: the same build's layers over a paged pool (``None`` where that build lacks them, and for half weights: a
        #: half model's paged pools are not the paged build's float32)
        builds = native_builds("decoder_layers_paged")
        self.paged_fn = None if self.half is not None else builds.get(choice.impl.removeprefix("cpu/"))
        self.num_layers = len(params)
        self.heads, self.kv_heads, self.head_dim = kv
        int8 = [(w, s) for layer in params for w, s in itertools.pairwise(layer) if w.dtype == torch.int8]
        #: every projection is float (a target, a float draft): prompts may run here too (:meth:`LeanStep.takes_prompt`)
        self.float_only = not int8
        #: the int8 projections can run W8A16 (a projection whose weight does not suit it runs weight-only) and W8A8
        #: (one scale per weight row and in_features % 64 == 0 everywhere): integer dots, in every build
        self.w8a16 = bool(int8)
        self.w8a8 = self.w8a16 and all(w8a8_fits(w, s) for w, s in int8)
        #: every int8 projection is a W8A8 ``Int8Linear``: every chunk runs W8A8, the modules' own maths (the same
        #: integer-dot kernel), prompts included (:meth:`mode`, :meth:`LeanStep.takes_prompt`)
        self.int8_activations = False
        #: the parameters with exact codes in place of float32 projection weights that have them (:mod:`.coded`),
        #: for chunks of up to ``CODED_MAX_ROWS`` rows (:meth:`params`); ``None`` where none has codes
        self.coded: list[torch.Tensor] | None = None
        #: the float32 weights ``coded`` replaces (checked for in-place changes: ``LeanStep.codes_stale``)
        self.coded_weights: list[torch.Tensor] = []
        self.codebook: CodeBook | None = None
        #: dtype of the K/V the native steps keep in the cache's growing layers: float16 halves what a step streams
        #: (at a batch of 4 rows and a ~450-token context the fp32 K/V of SmolLM2's 30 layers are ~80 MB, close to
        #: its int8 weights); a draft only proposes, so its keys' rounding can cost acceptance, never output
        self.kv_dtype = torch.float16

    def use_codes(self, codebook: CodeBook) -> None:
        """Run the float32 projection weights that are exact codes (``codebook``) from their codes in chunks of up to
        ``CODED_MAX_ROWS`` rows."""
        coded, replaced = list(self.flat), []
        for layer in range(self.num_layers):
            for at in _PROJECTION_AT:
                i = layer * len(LAYER_PARAMS) + at
                weight = self.flat[i]
                codes = codebook.get(weight) if weight.dtype == torch.float32 and weight.dim() == 2 else None
                if codes is not None:  # a half-precision weight runs half_linear, codes coded_linear
                    coded[i], coded[i + 1] = codes.codes, codes.params if codes.bits < 16 else _absent()
                    replaced.append(weight)
        self.codebook = codebook
        self.coded, self.coded_weights = (coded, replaced) if replaced else (None, [])

    def params(self, rows: int) -> list[torch.Tensor]:
        """The flat parameters a chunk of ``rows`` activation rows runs: codes where there are some and the chunk is
        narrow, else the float weights."""
        return self.coded if self.coded is not None and rows <= CODED_MAX_ROWS else self.flat

    def mode(self, rows: int, width: int) -> int:
        """How a chunk of ``rows`` activation rows (batch x width), ``width`` tokens wide, runs the int8
        projections: ``W8A8`` from ``W8A8_MIN_WIDTH`` tokens where possible, else ``W8A16`` from
        ``W8A16_MIN_ROWS`` rows where possible, else ``WEIGHT_ONLY``; always ``W8A8`` where the projections are W8A8
        modules (:attr:`int8_activations`: their own maths)."""
        if self.int8_activations or (self.w8a8 and width >= W8A8_MIN_WIDTH):
            return W8A8
        return W8A16 if self.w8a16 and rows >= W8A16_MIN_ROWS else WEIGHT_ONLY

    def head_kernel(self, mode: int, head: nn.Module, rows: int) -> Callable[..., torch.Tensor] | None:
        """The integer-dot kernel the int8 ``head`` runs with on ``rows`` rows for a chunk whose layers ran ``mode``
        (``None``: the weight-only kernel)."""
        if mode == WEIGHT_ONLY or not weight_only_native(head):
            return None
        weight, scale = head.qweight, head.scale
        if mode == W8A8 and w8a8_fits(weight, scale):
            return choose("w8a8_linear", "cpu", groups=1, in_features=weight.shape[1]).fn
        if rows >= W8A16_MIN_ROWS and w8a16_fits(weight.shape[1], scale.shape[1]):
            return choose("w8a16_linear", "cpu", groups=1).fn
        return None

    @staticmethod
    def build(step: Any, isa: str | None = None) -> NativeLayers | None:
        """The native layers of ``step``'s model (a :class:`~.step.LeanStep`), or ``None`` (:meth:`inspect` says
        why). ``isa``: that build only (tests)."""
        return NativeLayers.inspect(step, isa)[0]

    @staticmethod
    def inspect(step: Any, isa: str | None = None) -> tuple[NativeLayers | None, str]:
        """``(native layers, "")``, or ``(None, why not)``: weights not float32 / int8 on the CPU, a projection or MLP
        the native layers do not know, differing norm epsilons, or no build for this CPU."""
        norms = [step.norm]
        groups: set[int] = set()
        acts: set[str] = set()
        params = []
        scaling = step.layers[0].self_attn.scaling
        for index, layer in enumerate(step.layers):
            parts, why = _layer_params(layer, groups, acts, norms)
            if parts is None:
                return None, f"layer {index}: {why}"
            if layer.self_attn.scaling != scaling:
                return None, "the layers' attention scales differ"
            params.append(parts)
        if len({norm.variance_epsilon for norm in norms}) != 1:
            return None, "the RMSNorm epsilons differ"
        tensors = [t for layer in params for t in layer if t.numel()]
        if any(t.device.type != "cpu" or t.dtype not in (*_FLOAT_DTYPES, torch.int8) for t in tensors):
            return None, "the weights are not float32, bfloat16, float16 (or int8) on the CPU"
        scales = [t for layer in params for w, t in itertools.pairwise(layer) if w.dtype == torch.int8]
        if any(t.dtype != torch.float32 for t in scales):
            return None, "int8 scales are not float32"
        choice = layers_choice(groups, isa)
        if choice is None:
            return None, "no native build takes these weights: " + str(choose_layers_reasons(groups))
        why = _w8a8_mismatch(acts)
        if why is not None:
            return None, why
        kv = (step.heads, step.kv_heads, step.head_dim)
        rope = [bool(getattr(layer.self_attn, "use_rope", True)) for layer in step.layers]
        layers = NativeLayers(choice, params, float(step.norm.variance_epsilon), float(scaling), kv, rope)
        layers.int8_activations = acts == {"int8"}
        return layers, ""

    def run_tables(
        self, cos: torch.Tensor, sin: torch.Tensor
    ) -> Iterator[tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]]:
        """Each run of layers ``(start, stop)`` with the rotary tables it takes (``cos / sin [N, D]``; identity
        tables for layers without a rotary embedding)."""
        identity = None
        for start, stop, rotated in self.runs:
            if not rotated and identity is None:
                identity = (torch.ones_like(cos), torch.zeros_like(sin))
            yield (start, stop), ((cos, sin) if rotated else identity)

    def serves(self, cache: Any) -> bool:
        """Whether ``cache`` is one growing layer per decoder layer (the native call writes into its buffers)."""
        layers = getattr(cache, "layers", None)
        return (
            layers is not None
            and len(layers) == self.num_layers
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
        keys, values = [r[0] for r in reserved], [r[1] for r in reserved]
        flat, allowed = self.params(batch * width), allowed.contiguous()
        out = h.reshape(batch * width, hidden)
        for (start, stop), (c, s) in self.run_tables(cos.reshape(batch * width, dim), sin.reshape(batch * width, dim)):
            out = self.choice.fn(
                out, flat[start * len(LAYER_PARAMS) : stop * len(LAYER_PARAMS)], keys[start:stop],
                values[start:stop], used, allowed, c, s, heads, kv_heads, self.eps, self.scaling, mode,
            )  # [B*C, E]  # fmt: skip
        for layer in cache.layers:
            layer.commit(used + width)
        return out.view(batch, width, hidden)


def _w8a8_mismatch(acts: set[str]) -> str | None:
    """Why native layers cannot run int8 projections whose activations are ``acts`` (``None``: they can): one call
    runs every projection alike."""
    if "int8" not in acts:
        return None
    if len(acts) > 1:
        return "some int8 projections are W8A8 and others weight-only (one native call runs them alike)"
    return None


def paged_layers(
    native: NativeLayers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: Any, plan: Any, mode: int
) -> torch.Tensor:
    """Every layer of ``native`` on ``h [B, C, E]`` over a paged pool: ``pools`` the cache's layers (``keys`` /
    ``values`` ``[NB, BS, H_kv, D]`` float32), ``plan`` ``(slots [B*C] int64, block_tables [B, MB] int32, q_pos [B, C]
    int32)`` from the cache (copy-on-write copies already done). ``cos / sin [B, C, D]``. Returns ``[B, C, E]``."""
    batch, width, hidden = h.shape
    slots, tables, q_pos = plan
    flat, per = native.params(batch * width), len(LAYER_PARAMS)
    out = h.reshape(batch * width, hidden)
    for (start, stop), (c, s) in native.run_tables(cos.reshape(batch * width, -1), sin.reshape(batch * width, -1)):
        out = native.paged_fn(
            out, flat[start * per : stop * per], [p.keys for p in pools[start:stop]],
            [p.values for p in pools[start:stop]], slots, tables, q_pos, c, s, native.heads, native.kv_heads,
            native.eps, native.scaling, mode,
        )  # [B*C, E]  # fmt: skip
    return out.view(batch, width, hidden)


def _kind(module: Any) -> str:
    """A short description of a module the native layers do not take (its class, and a weight's dtype)."""
    weight = getattr(module, "weight", None)
    dtype = f"{str(weight.dtype).removeprefix('torch.')} " if isinstance(weight, torch.Tensor) else ""
    return f"a {dtype}{type(module).__name__}"


def _runs(rope: list[bool]) -> list[tuple[int, int, bool]]:
    """Consecutive layers with the same ``rope`` flag as ``(start, stop, rotated)`` runs."""
    runs: list[tuple[int, int, bool]] = []
    for index, rotated in enumerate(rope):
        if runs and runs[-1][2] == rotated:
            runs[-1] = (runs[-1][0], index + 1, rotated)
        else:
            runs.append((index, index + 1, rotated))
    return runs


def _layer_params(
    layer: nn.Module, groups: set[int], acts: set[str], norms: list[nn.Module]
) -> tuple[list[torch.Tensor] | None, str]:
    """One decoder layer's :data:`~hf_accel.kernels.reference.LAYER_PARAMS` tensors, or ``(None, why)`` where a part
    is not one the native layers know; its norms are added to ``norms``, int8 group sizes to ``groups`` and int8
    activation kinds to ``acts``."""
    attn = layer.self_attn
    norms += [layer.input_layernorm, layer.post_attention_layernorm]
    parts = [_projection(getattr(attn, name), groups, acts) for name in _ATTENTION_PARTS]
    for name, part in zip(_ATTENTION_PARTS, parts, strict=True):
        if part is None:
            kind = _kind(getattr(attn, name))
            return None, f"self_attn.{name} is {kind} (it takes float32 or int8 with a native kernel)"
    mlp = _mlp(layer.mlp, groups, acts)
    if mlp is None:
        return None, f"the MLP ({type(layer.mlp).__name__}) is not a SiLU-gated one with float / int8 projections"
    head_norms = [_absent(), _absent()]
    if hasattr(attn, "q_norm"):
        if not (is_rms_norm(attn.q_norm) and is_rms_norm(attn.k_norm)):
            return None, "its q/k norms are not RMSNorms"
        norms += [attn.q_norm, attn.k_norm]
        head_norms = [attn.q_norm.weight.detach(), attn.k_norm.weight.detach()]
    ln = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
    return [*ln, *[t for part in parts for t in part], *mlp, *head_norms], ""  # LAYER_PARAMS order
