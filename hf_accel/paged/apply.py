"""The ``paged`` feature: register paged attention for this model and add ``generate(paged=...)``.

Patching switches ``model.config._attn_implementation`` from ``<base>`` to ``"hf_accel_paged:<base>"``
(recorded; ``unpatch_model`` switches it back). Calls whose K/V do not come from a ``PagedCache`` go to the
base implementation unchanged, so ``generate`` without ``paged=`` behaves exactly as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..config import PagedConfig
from ..errors import IncompatibleOptionsError
from ..generate import GenerateCall, GenerateKwarg
from ..recorder import Recorder
from ..registry import ModelParts
from .attention import register, unpaged_name
from .cache import PAGED_ATTENTION_PREFIX, PagedCache, uses_paged_attention
from .runner import run_paged

if TYPE_CHECKING:
    from ..patch import PatchState

__all__ = ["apply_paged", "bind_paged"]

_CACHE_KEY = "paged_cache"


def apply_paged(model: nn.Module, parts: ModelParts, cfg: PagedConfig, recorder: Recorder) -> None:
    config = model.config
    base = getattr(config, "_attn_implementation", None) or "sdpa"
    if not isinstance(base, str):
        raise IncompatibleOptionsError(f"paged attention needs one attention implementation, got {base!r}")
    if base.startswith(PAGED_ATTENTION_PREFIX):
        raise IncompatibleOptionsError(f"the model already uses hf_accel's paged attention ({base!r})")
    name = register(base)

    def switch() -> None:
        config._attn_implementation = name

    def restore() -> None:
        config._attn_implementation = base

    recorder.call("paged", f"attention {base} -> {name}", switch, restore)
    recorder.set_instance_attr("paged", model, "generate_many", _generate_many(model), "generate_many bound")


def _generate_many(model: nn.Module) -> Any:
    def generate_many(prompts: Any, tokenizer: Any = None, engine: Any = None, **generate_kwargs: Any) -> list:
        """Generate for many prompts with continuous batching (:class:`hf_accel.Engine`); see
        :meth:`hf_accel.Engine.generate_many`. ``engine``: an existing engine of this model (default: one kept by
        the model, built on first use with the engine's defaults)."""
        from ..engine import Engine
        from ..patch import _get_state

        if engine is None:
            extras = _get_state(model).extras
            engine = extras.get("engine")
            if engine is None or engine.tokenizer is not tokenizer:
                engine = extras["engine"] = Engine(model, tokenizer)
        elif engine.model is not model:
            raise IncompatibleOptionsError("generate_many(engine=...) got an engine built for another model")
        return engine.generate_many(prompts, **generate_kwargs)

    return generate_many


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
