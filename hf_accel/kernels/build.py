"""hf_accel's CPU extension, built on first use with ``torch.utils.cpp_extension``: one module per instruction set.

Every source in ``kernels/cpu`` is compiled into each build with that build's flags (``avx2``: AVX2 + FMA + F16C;
``avx512``: AVX-512 F/BW/VL; ``avx512vnni``: AVX-512 with VNNI integer dot products), so a machine needs one build
(the widest its CPU runs) unless an op's constraints send a call to a narrower one. Which functions each build has is
the sources' business (``module.cpp``); which build and function a feature uses is :mod:`.ops`'. Builds land in
``$HF_ACCEL_CACHE/ext/<isa>-<sources sha>-torch<version>``, so changed sources build afresh, and are announced at
WARNING level (a first build takes about a minute).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from ..core.paths import cache_dir

__all__ = ["ISAS", "cpu_isas", "cpu_lacks", "extension", "extension_status"]

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("cpu")
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]
#: instruction set -> (torch CPU capabilities that run it, extra /proc/cpuinfo flags it needs, compiler flags),
#: widest first
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...], list[str]]] = {
    "avx512vnni": (("AVX512",), ("avx512_vnni",), [*_AVX512, "-mavx512vnni"]),
    "avx512": (("AVX512",), (), _AVX512),
    "avx2": (("AVX2", "AVX512"), (), ["-mavx2", "-mfma", "-mf16c"]),  # every AVX2 CPU has F16C
}

_modules: dict[str, ModuleType | None] = {}
_status: dict[str, str] = {}
_lock = threading.Lock()


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


def cpu_lacks(isa: str) -> str | None:
    """Why this CPU cannot run ``isa`` code (``None``: it can)."""
    capabilities, flags, _ = ISAS[isa]
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    missing = sorted(set(flags) - _cpu_flags())
    if capability not in capabilities or missing:
        return (
            f"this CPU lacks {isa.upper()} (capability {capability}{', no ' + ', '.join(missing) if missing else ''})"
        )
    return None


def cpu_isas() -> list[str]:
    """The instruction sets this CPU runs, widest first."""
    return [isa for isa in ISAS if cpu_lacks(isa) is None]


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


def _sources() -> list[Path]:
    return sorted(SOURCES.glob("*.cpp"))


@contextlib.contextmanager
def ticking(what: str, active: bool = True, every: float = 20.0) -> Iterator[None]:
    """While the block runs, log ``"hf_accel: still <what> (N s so far)"`` at WARNING level every ``every`` seconds,
    so a long one-time step (a kernel build) never looks like a hang."""
    if not active:
        yield
        return
    done, started = threading.Event(), time.perf_counter()

    def tick() -> None:
        while not done.wait(every):
            logger.warning("hf_accel: still %s (%.0f s so far)", what, time.perf_counter() - started)

    thread = threading.Thread(target=tick, name="hf_accel-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _build(isa: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    sha = hashlib.sha1(str(SOURCES.resolve()).encode())  # a checkout of its own: never rebuilt by another one
    for path in sorted(SOURCES.glob("*.*")):  # a changed source or header rebuilds
        sha.update(path.name.encode() + path.read_bytes())
    build_dir = cache_dir() / "ext" / f"{isa}-{sha.hexdigest()[:12]}-torch{torch.__version__.split('+')[0]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.warning("hf_accel: building the %s CPU kernels once (one to two minutes) in %s", isa, build_dir)
    started = time.perf_counter()
    with _build_lock(build_dir), ticking(f"building the {isa} CPU kernels (once per machine)", fresh):
        module = load(
            name=f"hf_accel_cpu_{isa}",
            sources=[str(p) for p in _sources()],
            extra_cflags=["-O3", *ISAS[isa][2], "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(SOURCES)],
            build_directory=str(build_dir),
            verbose=os.environ.get("HF_ACCEL_VERBOSE_BUILD") == "1",
        )
    if fresh:
        logger.warning("hf_accel: built the %s CPU kernels in %.0f s", isa, time.perf_counter() - started)
    return module


def extension(isa: str) -> ModuleType | None:
    """The CPU extension built for ``isa`` (``"avx2"``, ``"avx512"`` or ``"avx512vnni"``), or ``None`` when this CPU
    lacks it or the build failed (reason in :func:`extension_status`); built once per process (thread-safe)."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; known: {', '.join(ISAS)}")
    with _lock:
        if isa not in _modules:
            lacks = cpu_lacks(isa)
            if lacks is not None:
                _modules[isa], _status[isa] = None, lacks
            else:
                try:
                    _modules[isa], _status[isa] = _build(isa), f"native {isa.upper()} build"
                except (RuntimeError, OSError, ImportError) as err:  # no compiler / build failure
                    _modules[isa], _status[isa] = None, f"the {isa} build failed: {err}"
                    logger.warning("hf_accel: %s", _status[isa])
    return _modules[isa]


def extension_status(isa: str) -> str:
    """Why :func:`extension` returned what it did for ``isa``."""
    extension(isa)
    return _status[isa]
