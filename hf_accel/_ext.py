"""Native CPU kernels built on first use with ``torch.utils.cpp_extension`` (AVX2 + FMA or AVX-512 CPUs).

:func:`load_extension` returns the compiled module, or ``None`` with the reason in :func:`extension_status`
when it cannot be had here (no AVX2, no compiler). Callers choose a path explicitly and report it. Builds
land in ``$HF_ACCEL_CACHE/ext/<name>-<source sha>-torch<version>``, so a changed source builds afresh.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from .core.paths import cache_dir

__all__ = ["define_op", "extension_status", "load_extension"]

logger = logging.getLogger(__name__)

_INCLUDE = Path(__file__).with_name("csrc")  # headers shared by the kernels
_modules: dict[str, ModuleType | None] = {}
_status: dict[str, str] = {}
_ops: dict[str, torch.library.Library] = {}  # ops defined so far (lazily: never at import)
_ops_lock = threading.Lock()


_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"]
#: instruction set -> (CPU capabilities that run it, extra /proc/cpuinfo flags it needs, compiler flags)
_ISAS = {
    "avx2": (("AVX2", "AVX512"), (), ["-mavx2", "-mfma", "-mf16c"]),  # every AVX2 CPU has F16C
    "avx512": (("AVX512",), (), _AVX512),
    "avx512vnni": (("AVX512",), ("avx512_vnni",), [*_AVX512, "-mavx512vnni"]),
}


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none: the extra ISAs are then off)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_supports(isa: str) -> bool:
    capabilities, flags, _ = _ISAS[isa]
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    return capability in capabilities and set(flags) <= _cpu_flags()


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an OS lock on ``build_dir`` while building; clear a lock file left by a killed build.

    ``cpp_extension.load`` guards a build with a plain ``lock`` file that it waits on forever: a process
    killed mid-build leaves it behind and every later process would hang. The ``flock`` taken here is
    released by the OS when its holder dies, so whoever holds it knows a leftover ``lock`` file is stale.
    """
    if sys.platform == "win32":  # no flock: rely on cpp_extension's own lock
        yield
        return
    import fcntl

    with open(build_dir / "hf_accel.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another live process builds
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("hf_accel: removing %s left by an interrupted build", stale)
                stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(name: str, source: Path, isa: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    sha = hashlib.sha1(source.read_bytes())
    for header in sorted(_INCLUDE.glob("*.h")):  # a changed shared header rebuilds every kernel
        sha.update(header.read_bytes())
    digest = sha.hexdigest()[:12]
    build_dir = cache_dir() / "ext" / f"{name}-{digest}-torch{torch.__version__.split('+')[0]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("hf_accel: building the %s kernel in %s (once)", name, build_dir)
    with _build_lock(build_dir):
        return load(
            name=f"hf_accel_{name}",
            sources=[str(source)],
            extra_cflags=["-O3", *_ISAS[isa][2], "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(_INCLUDE)],
            build_directory=str(build_dir),
            verbose=os.environ.get("HF_ACCEL_VERBOSE_BUILD") == "1",
        )


def load_extension(name: str, source: Path, isa: str = "avx2") -> ModuleType | None:
    """The compiled module ``name`` built from ``source``, or ``None``; cached per process.

    Args:
        name: a short identifier (``"int8_gemm"``, ``"paged_attention"``).
        source: the C++ file.
        isa: the instruction set it is compiled for: ``"avx2"`` (AVX2 + FMA), ``"avx512"`` or ``"avx512vnni"``
            (AVX-512 with VNNI int8 dot products).

    Returns:
        The module, or ``None`` when the CPU lacks ``isa`` or the build failed (logged once, reason in
        :func:`extension_status`).
    """
    if name not in _modules:
        if not _cpu_supports(isa):
            _modules[name] = None
            _status[name] = f"this CPU lacks {isa.upper()} (capability {torch.backends.cpu.get_cpu_capability()})"
        else:
            try:
                _modules[name] = _build(name, source, isa)
                _status[name] = f"native {isa.upper()} kernel"
            except (RuntimeError, OSError, ImportError) as err:  # no compiler / build failure
                _modules[name] = None
                _status[name] = f"native kernel build failed: {err}"
                logger.warning("hf_accel: %s kernel: %s; using the pure-torch path", name, _status[name])
    return _modules[name]


def extension_status(name: str, source: Path, isa: str = "avx2") -> str:
    """Why :func:`load_extension` returned what it did."""
    load_extension(name, source, isa)
    return _status[name]


def define_op(
    name: str, schema: str, impl: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor],
    dispatch: str = "CompositeExplicitAutograd",
) -> Callable[..., torch.Tensor]:  # fmt: skip
    """Define ``torch.ops.hf_accel.<name>`` once per process: a kernel ``torch.compile`` keeps opaque.

    Args:
        name: the op's name; ``schema``: its arguments and result, e.g. ``"(Tensor x) -> Tensor"``.
        impl: the eager implementation, registered for ``dispatch``.
        fake: shapes-only implementation used while tracing.

    Returns:
        The op. Side effects: registers it (thread-safe; later calls return the same op). Called when a feature
        is applied or a module built, never at import.
    """
    with _ops_lock:
        if name not in _ops:
            lib = torch.library.Library("hf_accel", "FRAGMENT")
            lib.define(name + schema)
            lib.impl(name, impl, dispatch)
            torch.library.register_fake(f"hf_accel::{name}", fake, lib=lib)
            _ops[name] = lib
    return getattr(torch.ops.hf_accel, name)
