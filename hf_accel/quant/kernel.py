"""The native int8 kernel: built on first use with ``torch.utils.cpp_extension`` (AVX2 + FMA CPUs only).

``native_kernel()`` returns the compiled module, or ``None`` with the reason in :func:`kernel_status` when
it cannot be had here (no AVX2, no compiler). Callers choose a path explicitly and report it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from ..models import cache_dir

__all__ = ["kernel_status", "native_kernel"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "int8_gemm.cpp"
_state: dict[str, object] = {}


def _cpu_has_avx2() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return capability in ("AVX2", "AVX512")


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    digest = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:12]  # a changed source builds afresh
    build_dir = cache_dir() / "ext" / f"int8_gemm-{digest}-torch{torch.__version__.split('+')[0]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("hf_accel: building the int8 kernel in %s (once)", build_dir)
    return load(
        name="hf_accel_int8_gemm",
        sources=[str(_SOURCE)],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=os.environ.get("HF_ACCEL_VERBOSE_BUILD") == "1",
    )


def native_kernel() -> ModuleType | None:
    """The compiled kernel module, or ``None`` (see :func:`kernel_status` for why). Cached per process."""
    if "module" not in _state:
        if not _cpu_has_avx2():
            _state.update(module=None, status=f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2")
        else:
            try:
                _state.update(module=_build(), status="native AVX2 kernel")
            except (RuntimeError, OSError, ImportError) as err:  # no compiler / build failure
                _state.update(module=None, status=f"native kernel build failed: {err}")
                logger.warning("hf_accel: %s; int8 layers use the pure-torch path", _state["status"])
    return _state["module"]  # type: ignore[return-value]


def kernel_status() -> str:
    """Why :func:`native_kernel` returned what it did."""
    native_kernel()
    return str(_state["status"])
