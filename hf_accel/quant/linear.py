"""``Int8Linear`` / ``Int8Embedding``: modules holding int8 weights + float32 scales (no float weight)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import Int8Config
from ..kernels import portable
from ..kernels.ops import Choice, choose, op
from ..kernels.tuning import CPU
from .core import (
    ACT_BLOCK,
    QuantizedWeight,
    dequantize,
    dequantize_activations,
    dequantize_rows,
    quantize,
    quantize_activations,
)

__all__ = [
    "ACTIVATIONS",
    "DECODE_MAX_ROWS",
    "KERNEL_DTYPES",
    "Int8Embedding",
    "Int8Linear",
    "check_w8a8",
    "kernel_choice",
    "w8a8_fits",
]

#: What an :class:`Int8Linear` does with its input: ``"float"`` (weight-only) or ``"int8"`` (W8A8); the same
#: choices as ``Int8Config.activations``.
ACTIVATIONS = Int8Config.ACTIVATIONS

#: Activation dtypes the native CPU kernels take: float32 directly, bfloat16 / float16 as float32 copies of their
#: few decode rows (the weights, the bytes that matter, stay int8; sums are float32, the result is cast back)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Up to this many activation rows the native kernel runs; above (prefill) the weight is de-quantized once per call
DECODE_MAX_ROWS = CPU.int8_kernel_max_rows


def kernel_choice(activations: str, group_size: int, in_features: int, device: torch.device | str = "cpu") -> Choice:
    """The int8 linear implementation for these weights (:func:`hf_accel.kernels.ops.choose`): ``int8_linear``
    (weight-only) or ``w8a8_linear`` (``activations="int8"``), a native build or the reference."""
    if activations == "int8":
        return choose("w8a8_linear", device, groups=in_features // group_size, in_features=in_features)
    return choose("int8_linear", device, group_size=group_size)


def w8a8_fits(qweight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether int8 weights ``qweight [N, K]`` with scales ``scale [N, G]`` can run W8A8: one scale per row and
    ``K % ACT_BLOCK == 0`` (what :func:`check_w8a8` requires of a layer)."""
    return scale.shape[1] == 1 and qweight.shape[1] % ACT_BLOCK == 0


def check_w8a8(in_features: int, group_size: int | None) -> None:
    """Raise ``ValueError`` unless a layer can run W8A8: row weight scales and ``in_features % 64 == 0``."""
    if group_size is not None and group_size != in_features:
        raise ValueError(f"activations='int8' needs one weight scale per row (group_size=None), got {group_size}")
    if in_features % ACT_BLOCK:
        raise ValueError(f"activations='int8' needs in_features divisible by {ACT_BLOCK}, got {in_features}")


class Int8Linear(nn.Module):
    """A linear layer with symmetric int8 weights.

    Args:
        qw: the quantized weight (``[N, K]`` int8 + ``[N, G]`` scales).
        bias: ``[N]`` float bias or ``None``.
        activations: ``"float"``: weight-only (activations stay float); ``"int8"``: W8A8, activations quantized per
            row in 16 interleaved feature groups on every call (see :func:`~hf_accel.quant.core.w8a8_reference`),
            integer dot products on x86 CPUs with AVX2 (AVX-512 VNNI where the CPU has it), the same maths emulated
            in float elsewhere.

    Shapes:
        input ``[..., K]`` (any float dtype) -> output ``[..., N]`` of the input dtype.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, activations: str = "float") -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.out_features, self.in_features = qw.shape
        if activations == "int8":
            check_w8a8(self.in_features, qw.group_size)
        self.group_size = qw.group_size
        self.activations = activations
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scale", qw.scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        #: on CUDA, run the Triton W8A16 kernel where it loads (``False``: the portable de-quantize form, which a
        #: compiled step fuses; :meth:`use_device_kernel`)
        self.device_kernel = True
        self._bind_kernel()

    def _bind_kernel(self) -> None:
        #: the implementation this layer runs on its weights' device (chosen once per process by the kernel layer;
        #: chosen again when the module moves: ``_apply``)
        device = self.qweight.device if self.qweight.device.type != "meta" else torch.device("cpu")
        self.choice = kernel_choice(self.activations, self.group_size, self.in_features, device)
        cpu = self.choice.impl.startswith("cpu/")
        # the native function (None: the float maths below); the op's name, a string torch.compile guards on
        self._fn = self.choice.fn if cpu else None
        self._cpu_kernel = self.choice.op if cpu else ""
        # on an accelerator: the op's Triton kernel (kept opaque in a compiled step), else the portable form
        triton = self.choice.impl == "cuda/triton" and getattr(self, "device_kernel", True)
        self._device_op = self.choice.op if triton else ""
        if self._cpu_kernel or self._device_op:
            op(self._cpu_kernel or self._device_op)  # torch.ops.hf_accel.<op>: what a compiled step runs (opaque)

    def use_device_kernel(self, enabled: bool) -> None:
        """On CUDA, run the Triton W8A16 kernel (``True``, the default where Triton loads) or the portable forms
        (``False``: a de-quantized copy eagerly, the de-quantize form that Inductor fuses into the matmul in a
        compiled step): how the GPU benchmark compares the two. Kept across ``.to()``; no effect on the CPU.

        Raises:
            TypeError: ``enabled`` is not a bool.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"use_device_kernel takes a bool, got {type(enabled).__name__}")
        self.device_kernel = enabled
        self._bind_kernel()

    @property
    def cpu_native(self) -> bool:
        """Whether this layer's own maths is a native CPU kernel (its weights are on the CPU and a build takes them)."""
        return bool(self._cpu_kernel)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Int8Linear:
        super()._apply(fn, recurse)  # .to() / .cuda() / .half(): the buffers move, then the choice follows
        self._bind_kernel()
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_fn", None)  # native functions do not pickle: chosen again when loaded
        state.pop("choice", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind_kernel()  # this machine's choice

    @classmethod
    def from_module(cls, linear: nn.Module, group_size: int | None = None, activations: str = "float") -> Int8Linear:
        """Quantize an ``nn.Linear`` (the original is not modified).

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear`` or its weight is not floating point.
            ValueError: ``group_size`` does not divide ``in_features``; W8A8 asked of a layer it cannot take.
        """
        if type(linear) is not nn.Linear:
            raise TypeError(f"Int8Linear.from_module needs an nn.Linear, got {type(linear).__name__}")
        return cls(quantize(linear.weight, group_size), linear.bias, activations)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scale, self.group_size)

    def kernel_path(self, x: torch.Tensor) -> str:
        """Which path a call with ``x`` takes.

        Returns:
            ``"w8a8"`` (integer-dot kernel) or ``"w8a8-emulated"`` (float maths, other CPUs / devices / dtypes) for
            ``activations="int8"``; else ``"native"`` (weight-only kernel, <= 16 rows), ``"portable"`` (on an
            accelerator: the Triton kernel on CUDA, :mod:`hf_accel.kernels.triton_int8`; elsewhere
            :func:`hf_accel.kernels.portable.int8_linear`, or its fusable form when compiling) or ``"dequantize"``.
        """
        if x.device.type not in ("cpu", "meta") and self.activations == "float":
            return "portable"
        takes = x.device.type == "cpu" and x.dtype in KERNEL_DTYPES  # bf16 / fp16 rows go in as fp32 copies
        if self.activations == "int8":
            return "w8a8" if takes and self._cpu_kernel else "w8a8-emulated"
        rows = x.numel() // max(1, x.shape[-1])
        native = takes and self._cpu_kernel
        return "native" if native and rows <= DECODE_MAX_ROWS else "dequantize"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._cpu_kernel and x.dtype in KERNEL_DTYPES and x.is_cpu and not torch.compiler.is_dynamo_compiling()
        if fast and (self.activations == "int8" or x.numel() <= DECODE_MAX_ROWS * self.in_features):
            if x.dtype == torch.float32:
                return self.kernel(x)  # eager fast path (decode calls this ~200 times per step)
            return self.kernel(x.float()).to(x.dtype)  # [.., K] bf16/fp16: a few fp32 rows in, fp32 sums, cast out
        path = self.kernel_path(x)
        if path == "portable":  # [.., K] on an accelerator
            flat = x.reshape(-1, self.in_features)
            if self._device_op and torch.compiler.is_dynamo_compiling():  # the Triton kernel, opaque to the compiler
                y = getattr(torch.ops.hf_accel, self._device_op)(flat, self.qweight, self.scale)  # [M, N]
            elif self._device_op:  # eagerly: the same launcher, without the dispatcher's per-call cost
                y = self.choice.fn(flat, self.qweight, self.scale)
            elif torch.compiler.is_dynamo_compiling():
                y = portable.int8_linear_compiled(flat, self.qweight, self.scale)  # fused by Inductor
            else:
                y = portable.int8_linear(flat, self.qweight, self.scale)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], self.out_features)
        if path == "dequantize":
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, dequantize(self.quantized, x.dtype), bias)
        flat = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        if path == "w8a8-emulated":
            y = self._w8a8_emulated(flat)
        else:  # a kernel path here means compiling (eager calls took the fast path): an opaque op in the graph
            kernel = getattr(torch.ops.hf_accel, self._cpu_kernel)
            y = kernel(flat.float(), self.qweight, self.scale.float()).to(x.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel(
        self, x: torch.Tensor, vnni: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """This layer's native CPU kernel on ``x [..., K]`` float32 whatever the row count (``forward`` takes it
        for up to ``DECODE_MAX_ROWS`` rows, or always with W8A8). Only where :meth:`kernel_path` can say
        ``"native"`` or ``"w8a8"``: a CPU kernel exists and ``x`` is float32 on the CPU.

        Args:
            x: the input.
            vnni: a kernel with quantized activations ``(x [M, K], qweight, scale) -> [M, N]`` to run instead on this
                layer's int8 weights (one that suits them: e.g. the W8A8 or W8A16 kernel compiled into the draft's
                native layers, where their own checks accept the weights).
        """
        flat = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        # buffers read from the dict (nn.Module.__getattr__ costs ~0.7 us each)
        qweight, scale = self._buffers["qweight"], self._buffers["scale"]
        if scale.dtype != torch.float32:  # a model cast to bf16 / fp16 after quantizing casts the scales too
            scale = scale.float()
        y = (vnni or self._fn)(flat, qweight, scale)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _w8a8_emulated(self, flat: torch.Tensor) -> torch.Tensor:
        """The W8A8 maths in float: de-quantized activations times de-quantized weights. ``[M, K] -> [M, N]``."""
        xq, xscale = quantize_activations(flat.float())  # [M, K] int8, [M, 16]
        x = dequantize_activations(xq, xscale)  # [M, K]
        return F.linear(x, dequantize(self.quantized, torch.float32)).to(flat.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"bias={self.bias is not None}, activations={self.activations}"
        )


class Int8Embedding(nn.Module):
    """An embedding lookup that reads rows of an :class:`Int8Linear`'s weight (a tied LM head).

    Shapes:
        ``input_ids [...]`` -> ``[..., K]`` in ``dtype``.
    """

    def __init__(
        self, head: Int8Linear, dtype: torch.dtype, padding_idx: int | None = None, embed_scale: float | None = None
    ) -> None:
        super().__init__()
        self.embed_scale = embed_scale  # Gemma-style scaled embeddings multiply the lookup by sqrt(hidden)
        self.head = [head]  # a list: not registered as a submodule, so parameters are not listed twice
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        # rows of the head: q [..., K] int8, scale [..., G]
        out = dequantize_rows(head.qweight[input_ids], head.scale[input_ids], head.group_size, self.dtype)
        return out if self.embed_scale is None else out * torch.tensor(self.embed_scale, dtype=self.dtype)
