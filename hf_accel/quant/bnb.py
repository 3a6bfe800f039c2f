"""The bitsandbytes int8 backend: convert loaded ``nn.Linear`` layers to ``bitsandbytes`` ``Linear8bitLt``.

bitsandbytes is an optional dependency (``pip install "hf_accel[bnb]"``), imported only when this backend is
used. Its LLM.int8() matmul keeps outlier input features (``|x| > threshold``) in float and runs the rest
through an int8 GEMM. It is built for CUDA; on CPU it runs, slower than float (measured in docs/int8.md).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from .optional import is_layer_of, optional_module

__all__ = ["bnb_dequantize", "bnb_module", "is_bnb_linear", "to_bnb_linear"]

#: bitsandbytes stores ``CB = round(W * 127 / SCB)`` with ``SCB = max|W_row|`` per output row.
_INT8_MAX = 127.0


def bnb_module() -> ModuleType:
    """The imported ``bitsandbytes`` package.

    Raises:
        FeatureNotAvailableError: bitsandbytes is not installed.
    """
    return optional_module(
        "bitsandbytes",
        "int8 backend 'bitsandbytes' needs the bitsandbytes package: pip install 'hf_accel[bnb]' "
        "(or use Int8Config(backend='native'))",
    )


def is_bnb_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes 8-bit linear (ours or one loaded with ``load_in_8bit=True``).

    Checked by class name and module path, so it never imports bitsandbytes.
    """
    return is_layer_of(module, "Linear8bitLt", "bitsandbytes")


def to_bnb_linear(linear: nn.Linear, threshold: float) -> nn.Module:
    """A ``Linear8bitLt`` holding ``linear``'s weight quantized (the original is not modified).

    Args:
        linear: a float ``nn.Linear`` on any device bitsandbytes supports.
        threshold: LLM.int8() outlier threshold (0 disables the decomposition).

    Returns:
        The new module on ``linear``'s device, inference-only (``has_fp16_weights=False``).
    """
    bnb = bnb_module()
    weight = linear.weight
    new = bnb.nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=float(threshold),
        device="meta",
    )
    # bitsandbytes quantizes when a float CPU parameter moves to a device: hand it a CPU copy, then move.
    params = bnb.nn.Int8Params(weight.detach().to("cpu", copy=True), requires_grad=False, has_fp16_weights=False)
    new.weight = params.to(weight.device)
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return new


def bnb_dequantize(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``[N, K]`` a ``Linear8bitLt`` represents: ``CB * SCB / 127`` per output row.

    Raises:
        ValueError: the module holds no quantized int8 weight (e.g. trainable ``has_fp16_weights=True``).
    """
    weight = module.weight
    scb = getattr(weight, "SCB", None)
    if scb is None:  # after the first forward bitsandbytes keeps the scales in the layer's matmul state
        scb = getattr(getattr(module, "state", None), "SCB", None)
    if weight.dtype != torch.int8 or scb is None:
        raise ValueError(f"{type(module).__name__} holds no int8 weight with row scales (dtype {weight.dtype})")
    # CB: [N, K] int8, SCB: [N] row absmax
    return (weight.data.float() * (scb.float().unsqueeze(1) / _INT8_MAX)).to(dtype)
