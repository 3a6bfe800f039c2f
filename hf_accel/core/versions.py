"""The oldest PyTorch and Transformers releases hf_accel runs on, and the check every entry point makes.

pyproject.toml declares the same floors, so pip installs what is needed; this check catches an environment that got
around them (``--no-deps``, a conflicting pin, a source checkout on ``PYTHONPATH``) with an error that says what to
upgrade, instead of a failure deep inside ``generate``. It reads version strings only: it imports neither package.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import InvalidVersion, Version

from .errors import UnsupportedVersionError

__all__ = ["MINIMUM", "require_supported_versions", "unsupported_versions"]

#: distribution -> the oldest release the tests were run on and passed (docs/compatibility.md#versions), and why
MINIMUM: dict[str, tuple[str, str]] = {
    # Transformers 5.24 renamed the models' and generate's ``past_key_values`` argument to ``cache``, the name
    # hf_accel passes and reads everywhere; 5.17 rejects it ("model_kwargs are not used by the model: ['cache']").
    "transformers": ("5.24.0", "its models take the KV cache as `cache=` from 5.24 on"),
    # 2.6 (Transformers 5's own floor) fails 48 tests: Dynamo cannot trace Transformers' forward in a compiled step,
    # and the int8 quantizer and grouped-KV SDPA differ bitwise from the paths they must equal. 2.9 passes them.
    "torch": ("2.9.0", "compiled steps and bitwise-equal paths need it; the suite fails on 2.6"),
}


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _older(found: str, floor: str) -> bool:
    try:
        return Version(found).release < Version(floor).release  # "2.11.0+cu130", "5.25.0.dev0": release part only
    except InvalidVersion:
        return False  # an unparsable local build: trust its installer


def _too_old(versions: dict[str, str | None]) -> list[str]:
    """The distributions in ``versions`` installed older than their floor, in :data:`MINIMUM` order."""
    return [dist for dist, (floor, _) in MINIMUM.items() if (have := versions.get(dist)) and _older(have, floor)]


def _read() -> dict[str, str | None]:
    return {dist: _installed(dist) for dist in MINIMUM}


def unsupported_versions(versions: dict[str, str | None] | None = None) -> list[str]:
    """Each installed package older than hf_accel's floor, as ``"transformers 5.17.0 (needs >= 5.24.0: ...)"``.

    Args:
        versions: distribution -> installed version (``None``: not installed); default: read from this environment.
    """
    versions = versions if versions is not None else _read()
    return [f"{dist} {versions[dist]} (needs >= {MINIMUM[dist][0]}: {MINIMUM[dist][1]})" for dist in _too_old(versions)]


def require_supported_versions() -> None:
    """Raise :class:`UnsupportedVersionError` if an installed PyTorch or Transformers is older than hf_accel's floor."""
    versions = _read()
    old = _too_old(versions)
    if old:
        upgrade = " ".join(f"'{dist}>={MINIMUM[dist][0]}'" for dist in old)
        raise UnsupportedVersionError(
            f"hf_accel does not run on {'; '.join(unsupported_versions(versions))}. "
            f"Upgrade with: pip install --upgrade {upgrade}"
        )
