"""The per-instance ``generate`` wrapper of a patched model.

It takes hf_accel's own keyword arguments out of the call, lets the feature that owns each one translate it
into Transformers' terms (a ``cache=``, a ``custom_generate=`` callable, ...), and passes everything else to
the model's original ``generate`` untouched, so a misspelt argument still gets Transformers' own error.
"""

from __future__ import annotations

import functools
import time
import types
from typing import Any

import torch
from torch import nn

from .core.call import GenerateCall, device_of, eos_token_ids
from .core.errors import FeatureNotAvailableError, IncompatibleOptionsError
from .core.metrics import StepClock
from .core.recorder import Recorder
from .core.state import PatchState
from .paged.cache import PagedCache
from .speculative.apply import STATS_NOTE
from .speculative.auto import AUTO_NOTE

__all__ = ["PLUGIN_KWARGS", "bind_generate"]

#: Every ``generate`` keyword hf_accel owns -> the feature that implements it.
PLUGIN_KWARGS: dict[str, str] = {
    "paged": "paged",
    "speculative": "speculative",
    "draft_model": "speculative",
    "num_speculative_tokens": "speculative",
    "prompt_lookup": "speculative",
}


def _split_plugin_kwargs(state: PatchState, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = set(PLUGIN_KWARGS) | set(state.generate_kwargs)
    return {name: kwargs.pop(name) for name in list(kwargs) if name in names}


def _apply_plugin_kwargs(model: nn.Module, state: PatchState, plugin: dict[str, Any], call: GenerateCall) -> None:
    for name, value in plugin.items():
        handler = state.generate_kwargs.get(name)
        if handler is None:
            feature = PLUGIN_KWARGS[name]
            known = state.features.get(feature)
            if known is not None and known.apply is not None:  # implemented, but switched off for this model
                raise IncompatibleOptionsError(
                    f"generate({name}=...) needs hf_accel's {feature!r} feature, which is off for this model; "
                    f"patch it with hf_accel.patch_model(model, {feature}=True)"
                )
            raise FeatureNotAvailableError(
                f"generate({name}=...) needs hf_accel's {feature!r} feature, which this version does not provide"
            )
        handler.apply(model, value, call)


def _attach_clock(call: GenerateCall) -> StepClock:
    from transformers import StoppingCriteriaList

    clock = StepClock()
    given = call.kwargs.get("stopping_criteria")
    call.kwargs["stopping_criteria"] = StoppingCriteriaList([*(given or []), clock])
    return clock


def _eos_ids(model: nn.Module, kwargs: dict[str, Any]) -> set[int]:
    eos = kwargs.get("eos_token_id", "unset")
    if eos == "unset":
        eos = (kwargs.get("generation_config") or model.generation_config).eos_token_id
    return set(eos_token_ids(eos))


def _new_tokens(sequences: torch.Tensor, prompt_len: int, eos: set[int]) -> int:
    """Generated tokens, each row counted up to and including its first EOS (padding after it is not)."""
    tail = sequences[:, prompt_len:]
    if not eos or tail.numel() == 0:
        return int(tail.numel())
    hit = torch.isin(tail, torch.tensor(sorted(eos), device=tail.device))
    first = torch.where(
        hit.any(1), hit.int().argmax(1) + 1, torch.full_like(hit[:, 0], tail.shape[1], dtype=torch.long)
    )
    return int(first.sum())


def _kv_bytes(call: GenerateCall, out: Any, real_fraction: float) -> tuple[int | None, int | None]:
    cache = call.kwargs.get("cache")
    if isinstance(cache, PagedCache):  # the pool, and its high-water mark
        stats = cache.stats()
        return int(stats["bytes_reserved"]), int(stats["peak_blocks_used"]) * cache.block_bytes
    cache = getattr(out, "cache", None) if not isinstance(out, torch.Tensor) else None
    layers = getattr(cache, "layers", None)
    if not layers:
        return None, None
    held = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values) if t is not None)
    return held, int(held * real_fraction)  # a contiguous cache also holds padding


def _measure(model: nn.Module, call: GenerateCall, clock: StepClock, out: Any, device) -> Any:
    end = time.perf_counter()
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    ids = call.input_ids()
    prompt_len = ids.shape[-1] if ids is not None else 0
    mask = call.kwargs.get("attention_mask")
    expand = sequences.shape[0] // max(1, ids.shape[0] if ids is not None else 1)
    prompt_tokens = int(mask.sum()) * expand if mask is not None else prompt_len * sequences.shape[0]
    new = _new_tokens(sequences, prompt_len, _eos_ids(model, call.kwargs))
    fraction = (prompt_tokens + new) / max(1, sequences.numel())
    spec = call.notes.get(STATS_NOTE)
    return clock.stats(
        batch=sequences.shape[0],
        prompt_tokens=prompt_tokens,
        new_tokens=new,
        end=end,
        kv=_kv_bytes(call, out, fraction),
        peak_memory=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        speculative=spec.as_dict() if spec is not None else None,
        speculation_skipped=call.notes.get(AUTO_NOTE),
    )


def bind_generate(model: nn.Module, state: PatchState, recorder: Recorder) -> None:
    """Bind the wrapper as ``model.generate`` on this instance only (recorded, so unpatch removes it)."""
    original = model.generate  # bound method of the class, or a wrapper someone else bound before us

    @functools.wraps(original)
    def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        plugin = _split_plugin_kwargs(state, kwargs)
        call = GenerateCall(args, kwargs)
        _apply_plugin_kwargs(self, state, plugin, call)
        for hook in state.call_hooks:
            hook(self, call)
        clock = _attach_clock(call)
        device = device_of(self)
        out = call.run(original)
        state.extras["last_stats"] = _measure(self, call, clock, out, device)
        if not isinstance(out, torch.Tensor):
            out.metrics = state.extras["last_stats"]
        return out

    recorder.set_instance_attr("core", model, "generate", types.MethodType(generate, model), "generate wrapped")
