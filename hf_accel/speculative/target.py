"""The speculative target's own fast paths: greedy verification through an int8-screened LM head (:mod:`.screen`)
and verification chunks and prompts through the native executor (:mod:`hf_accel.native`)."""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from ..core.dispatch import is_tensor_parallel
from ..core.fingerprint import tensor_key
from ..kernels.ops import choose
from ..kernels.reference import w8a16_fits
from ..native.apply import NativeForward
from ..native.layers import has_hooks
from ..native.step import LEAN_MODEL_TYPES, LeanStep
from .screen import HeadScreen

__all__ = ["head_screen", "screen_obstacle", "target_obstacle", "target_step"]


def _own_forward(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its class's ``lm_head(model.model(...))``: no instance forward, or the native
    feature's (which computes exactly that)."""
    forward = vars(model).get("forward")
    return forward is None or isinstance(forward, NativeForward)


#: the head screens built so far, per LM head module: ``(the weight's tensor_key, screen)``
_SCREENS: weakref.WeakKeyDictionary[nn.Module, tuple[Hashable, HeadScreen]] = weakref.WeakKeyDictionary()


def screen_obstacle(model: nn.Module) -> str | None:
    """Why greedy verification cannot run ``model``'s LM head through an int8 screen (``None``: it can)."""
    head = getattr(model, "lm_head", None)
    if getattr(model.config, "model_type", None) not in LEAN_MODEL_TYPES:
        return f"model_type {model.config.model_type!r}: its logits are not known to be lm_head(model.model(...))"
    if not _own_forward(model):
        return "the instance's forward is replaced (e.g. the compiled paged step)"
    if is_tensor_parallel(model):  # a tensor-parallel head gathers its output across ranks
        return "tensor-parallel shards"
    if type(head) is not nn.Linear or not isinstance(getattr(model, "model", None), nn.Module):
        return f"the head is {type(head).__name__}, not a float nn.Linear"
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % 32:
        return f"the head is {weight.dtype} on {weight.device.type} with width {weight.shape[1]} (float32, CPU, 32k)"
    if has_hooks((model, head)):
        return "forward hooks must see the head"
    kernel = choose("w8a16_linear", "cpu", groups=1)
    if not kernel.native or not w8a16_fits(weight.shape[1], 1):
        return "no W8A16 kernel for it: " + "; ".join(dict.fromkeys(kernel.rejected.values()))
    return None


def head_screen(model: nn.Module) -> HeadScreen | None:
    """The int8 screen of ``model``'s LM head (built once, cached while the weight is unchanged), or ``None`` where
    :func:`screen_obstacle` says it does not apply (the loop reports that reason in its stats)."""
    if screen_obstacle(model) is not None:
        return None
    head = model.lm_head
    weight = head.weight
    key = tensor_key(weight)
    cached = _SCREENS.get(head)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():  # a weight made under inference_mode still says requires_grad
        screen = HeadScreen.build(weight, head.bias, choose("w8a16_linear", "cpu", groups=1).fn)
    _SCREENS[head] = (key, screen)
    return screen


def target_step(model: nn.Module) -> Any:
    """The target's verification chunks and prompt through the native executor
    (:class:`~hf_accel.native.step.LeanStep` with float32 K/V over a growing cache; one C++ call for all decoder layers
    instead of ~30 module calls, ~12% of a 4 x 13 chunk on SmolLM2), or ``None`` where they do not apply: the lean
    architectures with native layers for this model (float32 on the CPU, projections and MLPs they know), no hooks,
    no tensor-parallel shards, ``forward`` not replaced on the instance."""
    forward = vars(model).get("forward")
    if isinstance(forward, NativeForward):  # the native feature's executor: the same step (for the weights as they are)
        return forward.current_step()
    if forward is not None:
        return None
    return LeanStep.exact(model)


def target_obstacle(model: nn.Module) -> str:
    """Why :func:`target_step` gives no executor for ``model`` (for the loop's stats)."""
    if "forward" in vars(model) and not isinstance(vars(model)["forward"], NativeForward):
        return "the instance's forward is replaced (e.g. the compiled paged step)"
    why = LeanStep.unsupported(model)
    if why is not None:
        return why
    step = LeanStep.build(model, kv_dtype=torch.float32)
    return (step.why_not_native if step is not None else None) or "the native feature's executor is off"
