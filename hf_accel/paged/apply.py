"""The ``paged`` feature: register paged attention for this model and add ``generate(paged=...)``.

Patching switches ``model.config._attn_implementation`` from ``<base>`` to ``"hf_accel_paged:<base>"``
(recorded; ``unpatch_model`` switches it back). Calls whose K/V do not come from a ``PagedCache`` go to the
base implementation unchanged, so ``generate`` without ``paged=`` behaves exactly as before.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.call import GenerateCall, GenerateKwarg, device_of
from ..core.config import PagedConfig
from ..core.dispatch import model_dtype
from ..core.errors import IncompatibleOptionsError
from ..core.lease import LeasePool
from ..core.recorder import Recorder
from ..core.registry import ModelParts
from .attention import attention_choice, paged_name, register, unpaged_call, unpaged_name, unregister
from .cache import PagedCache
from .gqa import register_gqa, release_gqa
from .layer import PAGED_ATTENTION_PREFIX, uses_paged_attention
from .pool import pool_spec
from .runner import run_paged

if TYPE_CHECKING:
    from ..core.state import PatchState

__all__ = ["apply_paged", "bind_paged", "plain_paged"]

_CACHE_KEY = "paged_caches"
_POOLS_LOCK = threading.Lock()


def apply_paged(model: nn.Module, parts: ModelParts, cfg: PagedConfig, recorder: Recorder) -> None:
    config = model.config
    base = getattr(config, "_attn_implementation", None) or "sdpa"
    if not isinstance(base, str):
        raise IncompatibleOptionsError(f"paged attention needs one attention implementation, got {base!r}")
    if base.startswith(PAGED_ATTENTION_PREFIX):
        raise IncompatibleOptionsError(f"the model already uses hf_accel's paged attention ({base!r})")
    name = paged_name(base)
    # Transformers' attention registries are process-wide: held while this patch lasts (unpatch gives them back)
    recorder.call("paged", f"{name} registered with Transformers", lambda: register(base), lambda: unregister(base))
    _report_attention(model, cfg, recorder)

    def switch() -> None:
        config._attn_implementation = name

    def restore() -> None:
        config._attn_implementation = base

    recorder.call("paged", f"attention {base} -> {name}", switch, restore)


def plain_paged(copy: nn.Module) -> None:
    """A plain copy of a paged-patched model runs its base attention (for ``sdpa``, :func:`~.attention.unpaged_name`'s
    grouped-head form, the same results): it holds Transformers' caches only."""
    impl = getattr(copy.config, "_attn_implementation", None) or ""
    if impl.startswith(PAGED_ATTENTION_PREFIX):
        base = impl.split(":", 1)[1]
        copy.config._attn_implementation = unpaged_name(base)
        if base == "sdpa":  # the copy uses the grouped-head entry for as long as it lives
            register_gqa()
            weakref.finalize(copy, release_gqa)


def _report_attention(model: nn.Module, cfg: PagedConfig, recorder: Recorder) -> None:
    """Say in ``patch_report`` how decode-sized chunks will attend over this model's pools (each cache decides the
    same way for its layers' devices: :func:`~.attention.attention_choice`)."""
    try:
        spec = pool_spec(model, cfg.block_size, 1, None)
        choice = attention_choice(cfg.attention, spec.devices[0], spec.dtype, cfg.block_size, spec.head_dim)
    except IncompatibleOptionsError as err:  # e.g. attention='kernel' where it cannot run: a cache will refuse it
        recorder.choose("paged", "paged_attention", "refused", str(err))
        return
    recorder.choose("paged", "paged_attention", choice.impl, choice.why, choice.rejected)


def _with_base_attention(model: nn.Module, proceed: Any) -> Any:
    """Run ``proceed()`` (a call without a ``PagedCache``) on the base implementation's masks and attention.

    Transformers pre-builds 4D masks for compileable caches (``StaticCache``) while preparing generation inputs;
    through the paged mask function they would come out as ``PagedMask`` objects, which its mask code does not take.
    The switch is this thread's (:func:`~.attention.unpaged_call`): the shared config never changes, so other
    threads' paged calls and a running ``Engine`` are unaffected. (The paged attention function hands K/V that do not
    come from a ``PagedCache`` to the base function anyway: for ``sdpa``, without its K/V copies for grouped heads.)
    """
    if not uses_paged_attention(model):
        return proceed()
    with unpaged_call():
        return proceed()


def _lease_cache(model: nn.Module, state: PatchState, cfg: PagedConfig, call: GenerateCall) -> PagedCache:
    """A ``PagedCache`` for ``cfg`` lent to this call: the model keeps its caches across calls (pools and prefix tables
    are reused), one per concurrent call (threads never share one); given back when the call ends (:func:`bind_paged`'s
    hook). Kept caches follow the model: after ``model.to(dtype / device)`` new ones are built for it."""
    layout = (model_dtype(model), device_of(model))  # a model moved or cast since: caches built for it again
    with _POOLS_LOCK:
        pools = state.extras.setdefault(_CACHE_KEY, {})
        kept = pools.get(cfg)
        if kept is None or kept[0] != layout:  # the old pool (and every cache given back to it) is dropped
            kept = pools[cfg] = (layout, LeasePool())
    pool = kept[1]
    cache = pool.acquire(lambda: PagedCache.from_config(model, cfg))
    call.notes[_CACHE_KEY] = (pool, cache)
    return cache


def _give_back(call: GenerateCall, proceed: Any) -> Any:
    """Run the call, then return its leased cache to the model's pool (even when the call fails)."""
    try:
        return proceed()
    finally:
        pool, cache = call.notes.pop(_CACHE_KEY)
        pool.release(cache)


def bind_paged(model: nn.Module, state: PatchState, cfg: PagedConfig) -> None:
    """Add ``generate(paged=...)`` and run every ``generate`` that holds a ``PagedCache`` through the paged flow."""

    def apply_kwarg(model: nn.Module, value: Any, call: GenerateCall) -> None:
        if value is None or value is False:
            return
        if call.kwargs.get("cache") is not None:
            raise IncompatibleOptionsError("generate(paged=...) builds its own cache; do not also pass cache=")
        if call.kwargs.get("cache_implementation") is not None:
            raise IncompatibleOptionsError("generate(paged=...) cannot be combined with cache_implementation=")
        if call.kwargs.get("use_cache") is False:
            raise IncompatibleOptionsError("generate(paged=...) needs use_cache=True")
        if isinstance(value, PagedCache):
            call.kwargs["cache"] = value
        elif value is True:
            call.kwargs["cache"] = _lease_cache(model, state, cfg, call)
        elif isinstance(value, PagedConfig):
            call.kwargs["cache"] = _lease_cache(model, state, value, call)
        else:
            raise IncompatibleOptionsError(
                f"generate(paged=...) takes True, a PagedConfig or a PagedCache, got {type(value).__name__}"
            )

    def hook(model: nn.Module, call: GenerateCall) -> None:
        if _CACHE_KEY in call.notes:  # a leased cache goes back to the pool whatever happens (outermost wrapper)
            call.around.append(lambda proceed: _give_back(call, proceed))
        cache = call.kwargs.get("cache")
        if isinstance(cache, PagedCache):
            call.around.append(lambda proceed: run_paged(model, cache, call, proceed))
        else:  # another cache: the call runs on the base attention, exactly as unpatched
            call.around.append(lambda proceed: _with_base_attention(model, proceed))

    state.generate_kwargs["paged"] = GenerateKwarg("paged", "paged", apply_kwarg)
    state.call_hooks.append(hook)
