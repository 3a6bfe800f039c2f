"""Typed errors raised by hf_accel.

Every error derives from :class:`HFAccelError` *and* from the builtin exception that matches its meaning,
so ``except ValueError`` keeps working for callers that do not know hf_accel.
"""

from __future__ import annotations

from collections.abc import Iterable

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


class HFAccelError(Exception):
    """Base class of every error raised by hf_accel."""


class UnsupportedModelError(HFAccelError, TypeError):
    """The model is not a causal LM, or its architecture is not in the registry.

    Args:
        model_type: the offending ``config.model_type`` (or class name when there is no config).
        supported: the model types hf_accel knows.
        reason: an optional sentence that replaces the default explanation.
    """

    def __init__(self, model_type: str, supported: Iterable[str], reason: str | None = None) -> None:
        self.model_type = model_type
        self.supported = tuple(sorted(supported))
        why = reason or f"model_type {model_type!r} is not supported by hf_accel"
        super().__init__(f"{why}. Supported model types: {', '.join(self.supported)}.")


class AlreadyPatchedError(HFAccelError, RuntimeError):
    """``patch_model`` was called on a model that is already patched."""


class NotPatchedError(HFAccelError, RuntimeError):
    """``unpatch_model`` (or a query that needs a patch) was called on an unpatched model."""


class IncompatibleOptionsError(HFAccelError, ValueError):
    """Options that are individually valid but cannot be combined, or an unknown/mistyped option."""


class CheckpointError(IncompatibleOptionsError):
    """A checkpoint file that cannot be read as what it claims to be (truncated, garbage, a bad field); the message
    names the file and the field or tensor."""


class FeatureNotAvailableError(HFAccelError, NotImplementedError):
    """A feature was requested that this hf_accel build or this device does not provide."""


class DefaultModelNotInstalledError(HFAccelError, ImportError):
    """The package that ships the default model's weights is not installed."""


class UnsupportedVersionError(HFAccelError, ImportError):
    """An installed PyTorch or Transformers is older than the release hf_accel needs; the message says which and how
    to upgrade."""


class ModelNotFoundError(HFAccelError, FileNotFoundError):
    """A model path that is not a local Transformers checkpoint folder (nothing is ever downloaded)."""


class CacheFullError(HFAccelError, RuntimeError):
    """The KV block pool cannot hold what was asked of it.

    Args:
        needed: blocks the operation needs.
        free: blocks free in the pool.
        detail: optional context (which sequence, which operation).
    """

    def __init__(self, needed: int, free: int, detail: str = "") -> None:
        self.needed = needed
        self.free = free
        msg = f"KV block pool exhausted: {needed} blocks needed, {free} free"
        if detail:
            msg += f" ({detail})"
        msg += ". Give the cache more blocks (num_blocks= or max_memory=) or lower the batch size."
        super().__init__(msg)
