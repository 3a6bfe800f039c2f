"""Int8 experts of a mixture-of-experts layer.

Transformers keeps a MoE layer's experts as two 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
run by its experts implementation. :class:`Int8Experts` holds them as int8 tensors of the same names and shapes plus
float32 scales (``gate_up_proj_scale [E, 2I, G]``, ``down_proj_scale [E, H, G']``: a checkpoint's keys, as
Transformers' FP8 experts name theirs) and takes the same call as Transformers' module. Its two products are the op
``int8_experts_linear`` (:mod:`hf_accel.kernels.ops`), which groups the (token, expert) pairs by expert and reads
each hit expert's int8 rows once: on the CPU a native kernel, on CUDA a Triton kernel that lays the pairs out on the
device (no host sync: CUDA-graph safe). The int8 feature swaps every MoE layer's experts for one; a self-speculative
int8 draft builds its own from the target's float experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.registry import ArchSpec, named_experts, parent_and_name
from ..kernels import portable
from ..kernels.ops import Choice, choose, op
from .core import quantize
from .linear import DECODE_MAX_ROWS, KERNEL_DTYPES

__all__ = ["LAYOUT", "PROJECTIONS", "Int8Experts", "check_layout", "experts_choice", "quantize_experts"]

#: the storage Transformers' experts modules declare (``use_experts_implementation``) that :class:`Int8Experts` reads
LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
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
    """Raise ``TypeError`` unless ``experts`` stores its weights as :data:`LAYOUT` says (what :class:`Int8Experts`
    reads): concatenated [gate; up], no biases, ``[E, out, in]``."""
    layout = {name: getattr(experts, name, default) for name, default in LAYOUT.items()}
    if layout != LAYOUT:
        raise TypeError(f"{type(experts).__name__} stores its experts as {layout}; Int8Experts reads {LAYOUT}")


class Int8Experts(nn.Module):
    """A mixture of experts with int8 weights: ``down(act(gate(x)) * up(x))`` per chosen expert, weighted, summed.

    Args:
        tensors: ``{"gate_up_proj": [E, 2I, H] int8, "gate_up_proj_scale": [E, 2I, G] float32, "down_proj":
            [E, H, I] int8, "down_proj_scale": [E, H, G'] float32}`` ([gate; up] concatenated along ``2I``).
        act_fn: the activation of the gate (Transformers' module's ``act_fn``).

    Shapes:
        ``hidden [T, H]``, ``top_k_index [T, k]`` (expert ids; one outside ``[0, E)`` adds nothing),
        ``top_k_weights [T, k]`` -> ``[T, H]`` in the hidden dtype.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], act_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        for name in PROJECTIONS:
            self.register_buffer(name, tensors[name])
            self.register_buffer(f"{name}_scale", tensors[f"{name}_scale"])
        self.num_experts = tensors["gate_up_proj"].shape[0]
        self.act_fn = act_fn
        self.bind_kernel()

    @classmethod
    def from_module(cls, experts: nn.Module, group_size: int | None = None) -> Int8Experts:
        """Quantize Transformers' experts module (read, not modified) per output row or in groups of ``group_size``
        input columns, on its weights' device.

        Raises:
            TypeError: the module stores its experts another way (biases, transposed or interleaved weights, no gate).
            ValueError: ``group_size`` does not divide a projection's input features.
        """
        check_layout(experts)
        tensors = {}
        for name in PROJECTIONS:
            weight = getattr(experts, name).detach()  # [E, N, K]
            e, n, k = weight.shape
            qw = quantize(weight.reshape(e * n, k), group_size)  # in blocks of rows: no float copy of the whole
            tensors[name], tensors[f"{name}_scale"] = qw.qweight.view(e, n, k), qw.scale.view(e, n, -1)
        return cls(tensors, experts.act_fn)

    @classmethod
    def placeholder(cls, experts: nn.Module, group_size: int | None = None) -> Int8Experts:
        """An :class:`Int8Experts` on the meta device shaped for ``experts`` (what a loader fills with a checkpoint's
        int8 tensors, or with the float ones it quantizes as they arrive).

        Raises:
            TypeError: another storage layout (:data:`LAYOUT`).
            ValueError: ``group_size`` does not divide a projection's input features.
        """
        check_layout(experts)
        tensors = {}
        for name in PROJECTIONS:
            e, n, k = getattr(experts, name).shape
            size = k if group_size is None else group_size
            if k % size:
                raise ValueError(f"group_size={group_size} does not divide {name}'s {k} input features")
            tensors[name] = torch.empty(e, n, k, dtype=torch.int8, device="meta")
            tensors[f"{name}_scale"] = torch.empty(e, n, k // size, dtype=torch.float32, device="meta")
        return cls(tensors, experts.act_fn)

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
        """Projection ``name``'s weights de-quantized: ``[E, N, K]`` of ``dtype``."""
        q, scale = self._buffers[name], self._buffers[f"{name}_scale"]  # [E, N, K], [E, N, G]
        e, n, k = q.shape
        groups = scale.shape[2]
        return (q.view(e, n, groups, k // groups).float() * scale.float()[..., None]).view(e, n, k).to(dtype)

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

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        ids = top_k_index.long()
        gate_up = self._linear(hidden, ids, "gate_up_proj")  # [T, k, 2I]
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, k, I]
        inner = self.act_fn(gate) * up  # [T, k, I]
        down = self._linear(inner.reshape(tokens * k, -1), ids.reshape(-1, 1), "down_proj")  # [T * k, 1, H]
        weighted = down.view(tokens, k, -1).float() * top_k_weights.float()[..., None]  # [T, k, H]
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
