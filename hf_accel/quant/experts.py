"""Int8 experts of a mixture-of-experts layer.

Transformers keeps a MoE layer's experts as two 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
GPT-OSS stores them transposed, ``[E, in, out]``, with biases) run by its experts implementation. :class:`Int8Experts`
holds them as int8 tensors of the same names, always ``[E, out, in]``, plus float32 scales (``gate_up_proj_scale
[E, 2I, G]``, ``down_proj_scale [E, H, G']``: a checkpoint's keys, as Transformers' FP8 experts name theirs) and the
biases as they were, and takes the same call as Transformers' module. Its gating is the module's own
(``_apply_gate``: [gate; up] halves, or GPT-OSS's interleaved, clamped SwiGLU), on the rows in their stored order.
Its two products are the op ``int8_experts_linear`` (:mod:`hf_accel.kernels.ops`), which groups the (token, expert)
pairs by expert and reads each hit expert's int8 rows once: on the CPU a native kernel, on CUDA a Triton kernel that
lays the pairs out on the device (no host sync: CUDA-graph safe).
The int8 feature swaps every MoE layer's experts for one; a self-speculative int8 draft builds its own from the
target's float experts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.registry import ArchSpec, named_experts, parent_and_name
from ..kernels import portable
from ..kernels.ops import Choice, choose, op
from .core import quantize
from .linear import DECODE_MAX_ROWS, KERNEL_DTYPES

__all__ = [
    "LAYOUT",
    "PROJECTIONS",
    "Int8Experts",
    "check_layout",
    "experts_choice",
    "quantize_experts",
    "quantize_stack",
]

#: what :class:`Int8Experts` needs of the storage Transformers' experts modules declare (``use_experts_implementation``:
#: biases, transposed weights and interleaved gate / up rows are all read)
LAYOUT = {"has_gate": True, "has_post_expert_norm": False}
#: the weight dtypes :class:`Int8Experts` quantizes
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the experts' weights, each ``[E, out, in]``
PROJECTIONS = ("gate_up_proj", "down_proj")
#: the CPU kernel runs up to this many (token, expert) pairs per expert on average; above, each hit expert is
#: de-quantized once (Qwen3-30B-A3B's experts, float32, AVX-512: the kernel 277 ms against 353 at 32 pairs per
#: expert, the two meeting near 45; ``benchmarks/bench_int8_experts.py switch``, docs/log/2026-12-07-moe-int8.md)
CPU_KERNEL_ROWS_PER_EXPERT = 32


def experts_choice(group_size: int, device: torch.device | str) -> Choice:
    """The implementation of ``int8_experts_linear`` for experts quantized in groups of ``group_size`` on ``device``."""
    return choose("int8_experts_linear", device, group_size=group_size)


def check_layout(experts: nn.Module) -> None:
    """Raise ``TypeError`` unless ``experts`` is built as :data:`LAYOUT` says (what :class:`Int8Experts` reads): a
    gated ``gate_up_proj``, no norm after the experts, float weights (not a quantized checkpoint's packed bytes or
    FP8 values, such as GPT-OSS's MXFP4 experts)."""
    layout = {name: getattr(experts, name, default) for name, default in LAYOUT.items()}
    if layout != LAYOUT:
        raise TypeError(f"{type(experts).__name__} stores its experts as {layout}; Int8Experts reads {LAYOUT}")
    for name in PROJECTIONS:
        dtype = getattr(experts, name).dtype
        if dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{type(experts).__name__}.{name} holds {dtype}, not float weights (a quantized checkpoint's experts); "
                "load them de-quantized (GPT-OSS: Mxfp4Config(dequantize=True)) to quantize them to int8"
            )


def quantize_stack(weight: torch.Tensor, transposed: bool, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One experts weight (``[E, out, in]``, or ``[E, in, out]`` when ``transposed``) -> int8 ``[E, out, in]`` and
    float32 scales ``[E, out, G]`` (per output row, or per ``group_size`` inputs); one expert at a time when it must be
    transposed (no float copy of the whole)."""
    if not transposed:
        e, n, k = weight.shape
        qw = quantize(weight.reshape(e * n, k), group_size)  # in blocks of rows: no float copy of the whole
        return qw.qweight.view(e, n, k), qw.scale.view(e, n, -1)
    parts = [quantize(w.T.contiguous(), group_size) for w in weight.unbind(0)]  # each [in, out] -> [out, in]
    return torch.stack([p.qweight for p in parts]), torch.stack([p.scale for p in parts])


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _biases(experts: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """``{"<name>_bias": [E, out]}`` where the float module has biases (``has_bias``: GPT-OSS), else ``{}``."""
    bias = getattr(experts, f"{name}_bias", None) if getattr(experts, "has_bias", False) else None
    return {} if bias is None else {f"{name}_bias": bias}


def _gating(experts: nn.Module) -> nn.Module:
    """A weightless copy of ``experts`` whose ``_apply_gate`` is the module's own gating (Transformers' default:
    ``act_fn(gate) * up`` of the [gate; up] halves; GPT-OSS's: interleaved rows, clamped, ``alpha``): its settings and
    activation, none of its tensors (so the float weights can be released)."""
    shell = copy.copy(experts)
    shell._parameters, shell._buffers = {}, {}
    shell._modules = {k: m for k, m in experts._modules.items() if next(m.parameters(), None) is None}
    shell._forward_hooks, shell._forward_pre_hooks = {}, {}
    for name in ("forward", "_old_forward", "_hf_hook"):  # an accelerate hook's wrapped forward holds the module
        shell.__dict__.pop(name, None)
    return shell


class Int8Experts(nn.Module):
    """A mixture of experts with int8 weights: ``down(gating(gate_up(x) + b)) + b'`` per chosen expert, weighted,
    summed.

    Args:
        tensors: ``{"gate_up_proj": [E, 2I, H] int8, "gate_up_proj_scale": [E, 2I, G] float32, "down_proj":
            [E, H, I] int8, "down_proj_scale": [E, H, G'] float32}`` (the gate and up rows in the float module's
            order), plus ``"gate_up_proj_bias" [E, 2I]`` / ``"down_proj_bias" [E, H]`` where it had biases.
        gating: an object whose ``_apply_gate(gate_up)`` gates (:func:`_gating`: the float module's own).
        transposed: whether the float module stored its weights ``[E, in, out]``.

    Shapes:
        ``hidden [T, H]``, ``top_k_index [T, k]`` (expert ids; one outside ``[0, E)`` adds nothing),
        ``top_k_weights [T, k]`` -> ``[T, H]`` in the hidden dtype.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], gating: nn.Module, transposed: bool = False) -> None:
        super().__init__()
        for name in PROJECTIONS:
            self.register_buffer(name, tensors[name])
            self.register_buffer(f"{name}_scale", tensors[f"{name}_scale"])
            bias = tensors.get(f"{name}_bias")  # [E, out], as the float module held it (GPT-OSS)
            if bias is not None:
                self.register_parameter(f"{name}_bias", bias if isinstance(bias, nn.Parameter) else _frozen(bias))
        self.num_experts = tensors["gate_up_proj"].shape[0]
        #: whether the float module stored its weights ``[E, in, out]``: :meth:`dequantized` gives them back that way
        self.transposed = transposed
        object.__setattr__(self, "gating", gating)  # a weightless copy of the float module (not a submodule)
        self.bind_kernel()

    @classmethod
    def from_module(cls, experts: nn.Module, group_size: int | None = None) -> Int8Experts:
        """Quantize Transformers' experts module (read, not modified) per output row or in groups of ``group_size``
        input columns, on its weights' device; its biases are shared, not copied.

        Raises:
            TypeError: the module is built another way (:data:`LAYOUT`: no gate, a norm after the experts).
            ValueError: ``group_size`` does not divide a projection's input features.
        """
        check_layout(experts)
        transposed = bool(getattr(experts, "is_transposed", False))
        tensors = {}
        for name in PROJECTIONS:
            weight = getattr(experts, name).detach()  # [E, out, in] ([E, in, out] transposed)
            tensors[name], tensors[f"{name}_scale"] = quantize_stack(weight, transposed, group_size)
            tensors.update(_biases(experts, name))
        return cls(tensors, _gating(experts), transposed)

    @classmethod
    def placeholder(cls, experts: nn.Module, group_size: int | None = None) -> Int8Experts:
        """An :class:`Int8Experts` on the meta device shaped for ``experts`` (what a loader fills with a checkpoint's
        int8 tensors, or with the float ones it quantizes as they arrive) and its biases.

        Raises:
            TypeError: the module is built another way (:data:`LAYOUT`).
            ValueError: ``group_size`` does not divide a projection's input features.
        """
        check_layout(experts)
        transposed = bool(getattr(experts, "is_transposed", False))
        tensors = {}
        for name in PROJECTIONS:
            e, n, k = getattr(experts, name).shape
            n, k = (k, n) if transposed else (n, k)
            size = k if group_size is None else group_size
            if k % size:
                raise ValueError(f"group_size={group_size} does not divide {name}'s {k} input features")
            tensors[name] = torch.empty(e, n, k, dtype=torch.int8, device="meta")
            tensors[f"{name}_scale"] = torch.empty(e, n, k // size, dtype=torch.float32, device="meta")
            for key, bias in _biases(experts, name).items():
                tensors[key] = _frozen(torch.empty(bias.shape, dtype=bias.dtype, device="meta"))
        return cls(tensors, _gating(experts), transposed)

    @property
    def group_size(self) -> int | None:
        """Input columns per scale (``None``: one scale per output row), as ``Int8Config.group_size`` says."""
        gate_up, scale = self.gate_up_proj, self.gate_up_proj_scale  # [E, 2I, H], [E, 2I, G]
        if scale.shape[2] == 1 and self.down_proj_scale.shape[2] == 1:
            return None
        return gate_up.shape[2] // scale.shape[2]

    def bind_kernel(self) -> None:
        """Choose the implementation for the device the tensors are on (done on ``.to()``; a loader that replaced the
        tensors calls it)."""
        device = self.down_proj.device if self.down_proj.device.type != "meta" else torch.device("cpu")
        #: each projection's implementation on its weights' device (chosen again when it moves: ``_apply``)
        self.choices = {
            name: experts_choice(self._buffers[name].shape[2] // self._buffers[f"{name}_scale"].shape[2], device)
            for name in PROJECTIONS
        }
        op("int8_experts_linear")  # torch.ops.hf_accel.int8_experts_linear: what a compiled step runs (opaque)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Int8Experts:
        super()._apply(fn, recurse)
        self.bind_kernel()
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("choices", None)  # native functions do not pickle: chosen again when loaded
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.bind_kernel()

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Projection ``name``'s weights de-quantized, as the float module stored them: ``[E, out, in]`` of ``dtype``
        (``[E, in, out]`` for a transposed module's)."""
        q, scale = self._buffers[name], self._buffers[f"{name}_scale"]  # [E, N, K], [E, N, G]
        e, n, k = q.shape
        groups = scale.shape[2]
        weight = (q.view(e, n, groups, k // groups).float() * scale.float()[..., None]).view(e, n, k)
        return (weight.transpose(1, 2).contiguous() if self.transposed else weight).to(dtype)

    def _linear(self, x: torch.Tensor, ids: torch.Tensor, name: str) -> torch.Tensor:
        """``x [R, K]``, ``ids [R, J]`` -> ``[R, J, N]`` in ``x``'s dtype."""
        q, scale = self._buffers[name], self._buffers[f"{name}_scale"]
        if scale.dtype != torch.float32:  # a model cast to bf16 / fp16 after quantizing casts the scales too
            scale = scale.float()
        choice = self.choices[name]
        cpu = x.is_cpu and choice.impl.startswith("cpu/") and x.dtype in KERNEL_DTYPES
        if torch.compiler.is_dynamo_compiling():  # opaque to the compiler; on the CPU its kernel takes float32 rows
            xin = x.float() if cpu else x
            return torch.ops.hf_accel.int8_experts_linear(xin.contiguous(), ids, q, scale).to(x.dtype)
        if cpu and ids.numel() <= max(4 * DECODE_MAX_ROWS, CPU_KERNEL_ROWS_PER_EXPERT * self.num_experts):
            return choice.fn(x.float().contiguous(), ids, q, scale).to(x.dtype)
        if x.is_cpu:  # long prompts: a de-quantized matmul per expert hit
            return portable.int8_experts_linear(x, ids, q, scale)
        return choice.fn(x, ids, q, scale)

    def _biased(self, y: torch.Tensor, ids: torch.Tensor, name: str) -> torch.Tensor:
        """``y [T, k, N]`` plus each pair's expert bias of projection ``name`` (none for an id outside ``[0, E)``)."""
        bias = self._parameters.get(f"{name}_bias")  # [E, N]
        if bias is None:
            return y
        valid = (ids >= 0) & (ids < self.num_experts)  # [T, k]
        picked = bias[ids.clamp(0, self.num_experts - 1)]  # [T, k, N]
        return y + torch.where(valid[..., None], picked, 0).to(y.dtype)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The float module's gating of ``gate_up [T, k, 2I]`` -> ``[T, k, I]``."""
        apply = getattr(self.gating, "_apply_gate", None)
        if apply is not None:
            return apply(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # a Transformers without _apply_gate: [gate; up] halves
        return self.gating.act_fn(gate) * up

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        ids = top_k_index.long()
        gate_up = self._biased(self._linear(hidden, ids, "gate_up_proj"), ids, "gate_up_proj")  # [T, k, 2I]
        inner = self._gate(gate_up)  # [T, k, I]
        down = self._linear(inner.reshape(tokens * k, -1), ids.reshape(-1, 1), "down_proj")  # [T * k, 1, H]
        down = self._biased(down.view(tokens, k, -1), ids, "down_proj")  # [T, k, H]
        weighted = down.float() * top_k_weights.float()[..., None]  # [T, k, H]
        return weighted.sum(dim=1).to(hidden.dtype)

    def extra_repr(self) -> str:
        e, n, k = self.gate_up_proj.shape
        return f"num_experts={e}, hidden={k}, intermediate={n // 2}, group_size={self.group_size}"


def quantize_experts(model: nn.Module, spec: ArchSpec) -> tuple[int, list[str]]:
    """Replace every float experts module of ``model``'s MoE layers by an :class:`Int8Experts` (on the experts'
    device), in place and unrecorded: for a private copy such as a self-speculative draft. Experts stored another way
    (:func:`check_layout`: GPT-OSS's biased, transposed ones) stay as they are. Returns how many were replaced, and
    why the others stayed (one reason per kind)."""
    replaced, kept = 0, set()
    for name, experts in named_experts(model, spec):
        if isinstance(experts, Int8Experts):
            continue
        try:
            check_layout(experts)
        except TypeError as err:
            kept.add(str(err))
            continue
        parent, attr = parent_and_name(model, name)
        setattr(parent, attr, Int8Experts.from_module(experts))
        replaced += 1
    return replaced, sorted(kept)
