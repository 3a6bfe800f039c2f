"""The public home of hf_accel's typed errors (``from hf_accel.errors import CacheFullError``).

They are defined in :mod:`hf_accel.core.errors`, the bottom layer every module may import; this module only
re-exports them under the path the documentation names. The engine's own errors (``EngineStoppedError``,
``UnknownRequestError``, ``RequestFailedError``) are exported by :mod:`hf_accel` itself.
"""

from __future__ import annotations

from .core.errors import (
    AlreadyPatchedError,
    CacheFullError,
    CheckpointError,
    DefaultModelNotInstalledError,
    FeatureNotAvailableError,
    HFAccelError,
    IncompatibleOptionsError,
    ModelNotFoundError,
    NotPatchedError,
    UnsupportedModelError,
    UnsupportedVersionError,
)

__all__ = [
    "AlreadyPatchedError",
    "CacheFullError",
    "CheckpointError",
    "DefaultModelNotInstalledError",
    "FeatureNotAvailableError",
    "HFAccelError",
    "IncompatibleOptionsError",
    "ModelNotFoundError",
    "NotPatchedError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
]
