"""The native int8 kernel (``csrc/int8_gemm.cpp``), built on first use; see :mod:`hf_accel._ext`."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from .._ext import extension_status, load_extension

__all__ = ["kernel_status", "native_kernel"]

_SOURCE = Path(__file__).with_name("csrc") / "int8_gemm.cpp"


def native_kernel() -> ModuleType | None:
    """The compiled int8 kernel module, or ``None`` (see :func:`kernel_status` for why)."""
    return load_extension("int8_gemm", _SOURCE)


def kernel_status() -> str:
    """Why :func:`native_kernel` returned what it did."""
    return extension_status("int8_gemm", _SOURCE)
