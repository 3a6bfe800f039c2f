"""Optional backend packages (bitsandbytes, optimum-quanto): imported only when their backend is used, and their
layers recognised without importing them."""

from __future__ import annotations

import importlib
from types import ModuleType

from torch import nn

from ..core.errors import FeatureNotAvailableError

__all__ = ["is_layer_of", "optional_module"]


def optional_module(name: str, missing: str) -> ModuleType:
    """The imported package ``name``.

    Raises:
        FeatureNotAvailableError: it is not installed (message: ``missing``, which says how to install it).
    """
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise FeatureNotAvailableError(missing) from exc


def is_layer_of(module: nn.Module, class_name: str, package: str) -> bool:
    """Whether ``module``'s class is ``class_name`` from ``package`` (by name and module path: imports nothing)."""
    cls = type(module)
    return cls.__name__ == class_name and cls.__module__.startswith(package)
