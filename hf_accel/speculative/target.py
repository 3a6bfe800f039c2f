"""The speculative target's own fast paths: greedy verification through an int8-screened LM head (:mod:`.screen`)
and verification chunks and prompts through the native executor (:mod:`hf_accel.native`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..core.dispatch import is_tensor_parallel
from ..kernels.ops import choose
from ..kernels.reference import w8a16_fits
from ..native.apply import NativeForward
from ..native.layers import has_hooks
from ..native.step import LEAN_MODEL_TYPES, LeanStep
from .screen import HeadScreen

__all__ = ["head_screen", "target_step"]


def _own_forward(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its class's ``lm_head(model.model(...))``: no instance forward, or the native
    feature's (which computes exactly that)."""
    forward = vars(model).get("forward")
    return forward is None or isinstance(forward, NativeForward)


#: the head screens built so far, per LM head module: ``((weight pointer, version), screen)``
_SCREENS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int], HeadScreen]] = weakref.WeakKeyDictionary()


def head_screen(model: nn.Module) -> HeadScreen | None:
    """The int8 screen of ``model``'s LM head (built once, cached while the weight is unchanged), or ``None`` where
    it does not apply: the logits must be exactly ``lm_head(model.model(...))`` (the lean draft architectures,
    forward not replaced on the instance, no hooks), the head a float32 ``nn.Linear`` on the CPU, and the W8A16
    kernel (the AVX-512 VNNI build, :func:`hf_accel.kernels.ops.choose`) available for its width; not under tensor
    parallelism."""
    head = getattr(model, "lm_head", None)
    if getattr(model.config, "model_type", None) not in LEAN_MODEL_TYPES or not _own_forward(model):
        return None
    if is_tensor_parallel(model):  # a tensor-parallel head gathers its output across ranks
        return None
    if type(head) is not nn.Linear or not isinstance(getattr(model, "model", None), nn.Module):
        return None
    weight = head.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % 32:
        return None
    if has_hooks((model, head)):
        return None
    key = (weight.data_ptr(), weight._version)
    cached = _SCREENS.get(head)
    if cached is not None and cached[0] == key:
        return cached[1]
    kernel = choose("w8a16_linear", "cpu", groups=1)
    if not kernel.native or not w8a16_fits(weight.shape[1], 1):
        return None
    screen = HeadScreen.build(weight, head.bias, kernel.fn)
    _SCREENS[head] = (key, screen)
    return screen


def target_step(model: nn.Module) -> Any:
    """The target's verification chunks and prompt through the native executor
    (:class:`~hf_accel.native.step.LeanStep` with float32 K/V over a growing cache; one C++ call for all decoder layers
    instead of ~30 module calls, ~12% of a 4 x 13 chunk on SmolLM2), or ``None`` where they do not apply: the lean
    architectures with native layers for this model (float32 on the CPU, projections and MLPs they know), no hooks,
    no tensor-parallel shards, ``forward`` not replaced on the instance."""
    forward = vars(model).get("forward")
    if isinstance(forward, NativeForward):  # the native feature's executor: the same step
        return forward.step
    if forward is not None:
        return None
    return LeanStep.exact(model)
