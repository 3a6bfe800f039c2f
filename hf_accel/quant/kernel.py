"""The native int8 kernels, built on first use (see :mod:`hf_accel._ext`).

Weight-only: two builds of one algorithm (``csrc/int8_gemm.cpp``: AVX2, groups of 8+;
``csrc/int8_gemm_avx512.cpp``: AVX-512, groups of 16+), same ``int8_linear(x, q, scale)`` interface;
:func:`native_kernel` picks the widest one the CPU and the group size allow. W8A8: ``csrc/w8a8_vnni.cpp``
(AVX-512 VNNI), :func:`w8a8_kernel`.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from .._ext import extension_status, load_extension

__all__ = ["kernel_status", "native_kernel", "w8a8_kernel", "w8a8_status"]

_CSRC = Path(__file__).with_name("csrc")
_AVX2 = ("int8_gemm", _CSRC / "int8_gemm.cpp", "avx2")
_AVX512 = ("int8_gemm_avx512", _CSRC / "int8_gemm_avx512.cpp", "avx512")
_VNNI = ("w8a8_vnni", _CSRC / "w8a8_vnni.cpp", "avx512vnni")


def native_kernel(group_size: int | None = None) -> ModuleType | None:
    """The int8 kernel module for weights quantized in groups of ``group_size`` (``None``: any multiple of 16).

    Returns:
        The AVX-512 build where the CPU has AVX-512 and the group is a multiple of 16, else the AVX2 build for
        groups that are multiples of 8, else ``None`` (see :func:`kernel_status` for why).
    """
    if group_size is None or group_size % 16 == 0:
        kernel = load_extension(*_AVX512)
        if kernel is not None:
            return kernel
    if group_size is None or group_size % 8 == 0:
        return load_extension(*_AVX2)
    return None


def w8a8_kernel() -> ModuleType | None:
    """The W8A8 kernel module (``w8a8_linear``, ``quantize_activations``): AVX-512 VNNI CPUs, else ``None``."""
    return load_extension(*_VNNI)


def w8a8_status() -> str:
    """Why :func:`w8a8_kernel` returned what it did."""
    return extension_status(*_VNNI)


def kernel_status() -> str:
    """Which int8 kernels this machine runs, and why not the others."""
    return (
        f"AVX-512: {extension_status(*_AVX512)}; AVX2: {extension_status(*_AVX2)}; W8A8 (AVX-512 VNNI): {w8a8_status()}"
    )
