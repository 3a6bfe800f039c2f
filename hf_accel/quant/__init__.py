"""Weight-only int8: pure core, kernels, modules and the model adapter."""

from .core import QuantizedWeight, dequantize, quantization_error, quantize
from .experts import Int8Experts
from .linear import Int8Embedding, Int8Linear

__all__ = [
    "Int8Embedding",
    "Int8Experts",
    "Int8Linear",
    "QuantizedWeight",
    "dequantize",
    "quantization_error",
    "quantize",
]
