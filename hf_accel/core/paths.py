"""Where hf_accel keeps files on disk."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Root of hf_accel's on-disk cache: ``$HF_ACCEL_CACHE`` or ``~/.cache/hf_accel`` (converted default model,
    native kernel builds)."""
    return Path(os.environ.get("HF_ACCEL_CACHE") or Path.home() / ".cache" / "hf_accel")
