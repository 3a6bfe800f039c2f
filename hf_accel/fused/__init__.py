"""Fused gated MLPs."""

from .mlp import FusedGatedMLP
from .packed import PackedLinear

__all__ = ["FusedGatedMLP", "PackedLinear"]
