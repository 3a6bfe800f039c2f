"""Fused gated MLPs."""

from .mlp import FusedGatedMLP

__all__ = ["FusedGatedMLP"]
