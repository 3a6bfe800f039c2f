"""The ``paged`` feature: register paged attention for this model and add ``generate(paged=...)``.

Patching switches ``model.config._attn_implementation`` from ``<base>`` to ``"hf_accel_paged:<base>"``
(recorded; ``unpatch_model`` switches it back). Calls whose K/V do not come from a ``PagedCache`` go to the
base implementation unchanged, so ``generate`` without ``paged=`` behaves exactly as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.call import GenerateCall, GenerateKwarg
from ..core.config import PagedConfig
from ..core.errors import IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.registry import ModelParts
from .attention import attention_choice, register, unpaged_name
from .cache import PagedCache
from .layer import PAGED_ATTENTION_PREFIX, uses_paged_attention
from .pool import pool_spec
from .runner import run_paged

if TYPE_CHECKING:
    from ..core.state import PatchState

__all__ = ["apply_paged", "bind_paged", "plain_paged"]

_CACHE_KEY = "paged_cache"


def apply_paged(model: nn.Module, parts: ModelParts, cfg: PagedConfig, recorder: Recorder) -> None:
    config = model.config
    base = getattr(config, "_attn_implementation", None) or "sdpa"
    if not isinstance(base, str):
        raise IncompatibleOptionsError(f"paged attention needs one attention implementation, got {base!r}")
    if base.startswith(PAGED_ATTENTION_PREFIX):
        raise IncompatibleOptionsError(f"the model already uses hf_accel's paged attention ({base!r})")
    name = register(base)
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
        copy.config._attn_implementation = unpaged_name(impl.split(":", 1)[1])


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
    """Run ``proceed()`` on the model's original attention implementation (for ``sdpa``, the same function without
    its K/V copies for grouped heads: :func:`~.attention.unpaged_name`).

    Transformers pre-builds 4D masks for compileable caches (``StaticCache``) while preparing generation
    inputs; through the paged mask function they would come out as ``PagedMask`` objects, which its mask code
    does not accept. Non-paged calls therefore use the base implementation for their whole duration.
    """
    if not uses_paged_attention(model):
        return proceed()
    config = model.config
    name = config._attn_implementation
    config._attn_implementation = unpaged_name(name.split(":", 1)[1])
    try:
        return proceed()
    finally:
        config._attn_implementation = name


def _cache_for(model: nn.Module, state: PatchState, cfg: PagedConfig) -> PagedCache:
    """The model's own PagedCache for ``cfg`` (kept across calls so the pool and prefix table are reused)."""
    kept = state.extras.get(_CACHE_KEY)
    if kept is not None and kept[0] == cfg:
        return kept[1]
    cache = PagedCache.from_config(model, cfg)
    state.extras[_CACHE_KEY] = (cfg, cache)
    return cache


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
            call.kwargs["cache"] = _cache_for(model, state, cfg)
        elif isinstance(value, PagedConfig):
            call.kwargs["cache"] = _cache_for(model, state, value)
        else:
            raise IncompatibleOptionsError(
                f"generate(paged=...) takes True, a PagedConfig or a PagedCache, got {type(value).__name__}"
            )

    def hook(model: nn.Module, call: GenerateCall) -> None:
        cache = call.kwargs.get("cache")
        if isinstance(cache, PagedCache):
            call.around.append(lambda proceed: run_paged(model, cache, call, proceed))
        else:  # another cache: the call runs on the base attention, exactly as unpatched
            call.around.append(lambda proceed: _with_base_attention(model, proceed))

    state.generate_kwargs["paged"] = GenerateKwarg("paged", "paged", apply_kwarg)
    state.call_hooks.append(hook)
