"""Weight-only int8: pure core, kernels, modules and the model adapter."""

from .core import QuantizedWeight, dequantize, quantization_error, quantize
from .linear import Int8Embedding, Int8Linear

__all__ = ["Int8Embedding", "Int8Linear", "QuantizedWeight", "dequantize", "quantization_error", "quantize"]
