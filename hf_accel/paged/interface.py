"""hf_accel's entries in Transformers' process-wide attention registries, counted by user.

``AttentionInterface`` / ``AttentionMaskInterface`` are global: an entry added for one patched model is visible to
every model in the process. Each entry is therefore added when its first user (a patched model, a plain copy of one)
appears and removed when its last one goes (``unpatch_model``, the copy collected), so that unpatching every model
leaves Transformers' registries as they were. Transformers offers ``register`` but no removal: removal deletes the
class-wide mapping entry itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["acquire", "release", "users"]

_USERS: dict[str, int] = {}
_LOCK = threading.Lock()


def _interfaces() -> tuple[type, type]:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface, AttentionMaskInterface


def acquire(
    name: str, attention: Callable[[], Callable[..., object]], mask: Callable[[], Callable[..., object]]
) -> None:
    """One more user of ``name``; the first registers ``attention()`` and ``mask()`` (factories: made only then)."""
    attention_interface, mask_interface = _interfaces()
    with _LOCK:
        if _USERS.get(name, 0) == 0:
            attention_interface.register(name, attention())
            mask_interface.register(name, mask())
        _USERS[name] = _USERS.get(name, 0) + 1


def release(name: str) -> None:
    """One user of ``name`` fewer; the last one removes the entries (no-op for a name never acquired)."""
    attention_interface, mask_interface = _interfaces()
    with _LOCK:
        count = _USERS.get(name, 0) - 1
        if count > 0:
            _USERS[name] = count
            return
        _USERS.pop(name, None)
        # Transformers has no unregister: its class-wide mappings are plain dicts
        attention_interface._global_mapping.pop(name, None)
        mask_interface._global_mapping.pop(name, None)


def users(name: str) -> int:
    """How many users hold ``name`` now (tests and reports)."""
    with _LOCK:
        return _USERS.get(name, 0)
