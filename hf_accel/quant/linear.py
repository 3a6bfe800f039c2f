"""``Int8Linear`` / ``Int8Embedding``: modules holding int8 weights + float32 scales (no float weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .core import QuantizedWeight, dequantize, dequantize_rows, quantize
from .kernel import native_kernel

__all__ = ["DECODE_MAX_ROWS", "Int8Embedding", "Int8Linear"]

#: Up to this many activation rows the native GEMV-style kernel runs; above it (prefill) the weight is
#: de-quantized once per call and MKL's GEMM does the work (compute-bound there, so int8 does not help).
DECODE_MAX_ROWS = 16


class Int8Linear(nn.Module):
    """A linear layer with symmetric int8 weights.

    Args:
        qw: the quantized weight (``[N, K]`` int8 + ``[N, G]`` scales).
        bias: ``[N]`` float bias or ``None``.

    Shapes:
        input ``[..., K]`` (any float dtype) -> output ``[..., N]`` of the input dtype.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scale", qw.scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._kernel = native_kernel(qw.group_size)

    @classmethod
    def from_module(cls, linear: nn.Module, group_size: int | None = None) -> Int8Linear:
        """Quantize an ``nn.Linear`` (the original is not modified).

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear`` or its weight is not floating point.
            ValueError: ``group_size`` does not divide ``in_features``.
        """
        if type(linear) is not nn.Linear:
            raise TypeError(f"Int8Linear.from_module needs an nn.Linear, got {type(linear).__name__}")
        return cls(quantize(linear.weight, group_size), linear.bias)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scale, self.group_size)

    def kernel_path(self, x: torch.Tensor) -> str:
        """``"native"`` or ``"dequantize"``: which path a call with ``x`` takes."""
        rows = x.numel() // max(1, x.shape[-1])
        native = self._kernel is not None and x.device.type == "cpu" and x.dtype == torch.float32
        return "native" if native and rows <= DECODE_MAX_ROWS else "dequantize"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_path(x) == "native":
            flat = x.reshape(-1, self.in_features).contiguous()  # [M, K]
            y = self._kernel.int8_linear(flat, self.qweight, self.scale)  # [M, N]
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, dequantize(self.quantized, x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}, native={self._kernel is not None}"
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
