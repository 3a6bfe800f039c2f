"""The optimum-quanto int8 backend: ``QLinear`` layers with qint8 weights (one scale per output row).

optimum-quanto is an optional dependency (``pip install optimum-quanto``), imported only when this backend is
used. It serves devices hf_accel's native kernels do not cover (Apple MPS); on the CPU the
native backend is faster (docs/int8.md has the measured figures).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from .optional import is_layer_of, optional_module

__all__ = ["is_quanto_linear", "quanto_dequantize", "quanto_module", "to_quanto_linear"]


def quanto_module() -> ModuleType:
    """The imported ``optimum.quanto`` package.

    Raises:
        FeatureNotAvailableError: it is not installed.
    """
    return optional_module(
        "optimum.quanto", "Int8Config(backend='quanto') needs optimum-quanto: pip install optimum-quanto"
    )


def is_quanto_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an optimum-quanto ``QLinear`` (by class and module path: never imports quanto)."""
    return is_layer_of(module, "QLinear", "optimum.quanto")


def to_quanto_linear(linear: nn.Linear) -> nn.Module:
    """A frozen ``QLinear`` with qint8 weights built from ``linear`` (which is not modified)."""
    quanto = quanto_module()
    layer = quanto.QLinear.from_module(linear, weights=quanto.qint8)
    layer.freeze()  # the weight is stored quantized from now on
    return layer


def quanto_dequantize(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The float ``[out, in]`` weight a ``QLinear`` computes with."""
    return module.qweight.dequantize().to(dtype)
