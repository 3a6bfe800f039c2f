"""Regional compilation of the paged decode step (``CompileConfig(regional=...)``).

Compiling the whole decode step traces and compiles every decoder layer: on SmolLM2's 30 layers the first call
spends ~96 s compiling on a 2-core CPU (docs/compile.md). The layers of a model run the same code on weights of the
same shapes, so one graph can serve them all. The regional step runs the model's ``forward`` eagerly (embedding,
rotary tables, final norm, LM head) and each decoder layer through one compiled copy of its class's ``forward`` per
*kind* of layer (``config.layer_types``: full or sliding attention; SmolLM3's layers without a rotary embedding are
a kind of their own, and so are the mixture-of-experts layers of a model with dense ones; one kind for most
models). Dynamo inlines the
layer's submodules and takes their weights as graph inputs, so the graph does not depend on which layer runs it; the
layer gets only its own pools (:class:`~hf_accel.paged.step_op.DecodePlan` with one pool instead of every layer's),
so it never reads its index.

Each patched model compiles its own copies (dynamo keeps graphs and its recompile limit per code object).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..paged.attention import PLAN_KWARG
from ..paged.step_op import DecodePlan

if TYPE_CHECKING:
    from .paged_step import CompiledPagedDecode

__all__ = ["LayerSlot", "RegionalLayer", "compile_layers", "layer_slots", "own_code_copy"]


class LayerSlot(NamedTuple):
    """A decoder layer of a regionally compiled model: the module, its pools' index in the plan, and its kind."""

    layer: nn.Module
    pool: int
    kind: str


def layer_slots(model: nn.Module, layers: list[tuple[nn.Module, nn.Module, int, bool]]) -> tuple[LayerSlot, ...]:
    """``(decoder layer, attention module, position, mixture of experts?)`` of every layer -> its :class:`LayerSlot`
    (the pool index is the attention's ``layer_idx``, as the cache's; the kind is ``config.layer_types[i]`` where the
    config has them, whether the attention rotates (a graph guards on SmolLM3's per-layer ``use_rope``) and whether
    the MLP is a mixture of experts (GLM-4.5's dense first layers run other modules than its MoE layers))."""
    types_ = getattr(getattr(model, "config", None), "layer_types", None)
    slots = []
    for layer, attention, position, moe in layers:
        pool = getattr(attention, "layer_idx", position)
        kind = str(types_[pool]) if types_ is not None and pool < len(types_) else "layer"
        rope = "" if getattr(attention, "use_rope", True) else ":no-rope"
        slots.append(LayerSlot(layer, pool, f"{type(layer).__name__}:{kind}{rope}{':moe' if moe else ''}"))
    return tuple(slots)


def own_code_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own. Dynamo keeps graphs and its recompile limit (8) per code object, and
    each model's graphs guard on that model: compiling one shared function, the ninth patched model of a process
    would fall back to eager (or fail with fullgraph). Each model compiles its own copy instead."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_layers(
    slots: tuple[LayerSlot, ...], compile_kwargs: dict[str, Any]
) -> tuple[dict[str, Any], tuple[types.CodeType, ...]]:
    """One compiled copy of the layer class's ``forward`` per kind: ``{kind: compiled function}`` (called with the
    layer module first), and the copies' code objects (which hold the graphs)."""
    compiled: dict[str, Any] = {}
    codes: list[types.CodeType] = []
    for slot in slots:
        if slot.kind not in compiled:
            own = own_code_copy(type(slot.layer).forward)
            compiled[slot.kind] = torch.compile(own, **compile_kwargs)
            codes.append(own.__code__)
    return compiled, tuple(codes)


def _mark_dynamic(values: list[Any], rows: int, width: int) -> None:
    """Mark the batch (``rows`` > 1) and chunk (``width`` > 1) dimensions of the layer's inputs as dynamic, as the
    whole step marks its own: one graph for every batch size > 1 and every chunk width > 1."""
    for value in values:
        for t in value if isinstance(value, tuple) else (value,):
            if not isinstance(t, torch.Tensor) or t.ndim < 2:
                continue
            if rows > 1 and t.shape[0] == rows:
                torch._dynamo.maybe_mark_dynamic(t, 0)
            if width > 1 and t.shape[1] == width:
                torch._dynamo.maybe_mark_dynamic(t, 1)


class RegionalLayer:
    """A decoder layer's ``forward`` (bound on the instance): inside a regional paged step (a plan among the keyword
    arguments, outside any compiled region) it runs the kind's compiled ``forward`` with this layer's pools; every
    other call runs the class's ``forward`` unchanged.

    Args:
        step: the model's compiled paged step (it owns the compiled functions, per device type).
        slot: this layer.
    """

    def __init__(self, step: CompiledPagedDecode, slot: LayerSlot) -> None:
        self.step, self.slot = step, slot
        self.original = types.MethodType(type(slot.layer).forward, slot.layer)
        self._compiled: dict[str, Any] = {}  # device type -> the kind's compiled forward
        self._shapes: set[tuple[str, bool, bool]] = set()  # (device type, rows > 1, width > 1) already marked

    def __deepcopy__(self, memo: dict[int, object]) -> Any:
        copied = memo.get(id(self.slot.layer))  # a deep copy of the model gets the class's plain forward
        return None if copied is None else types.MethodType(type(copied).forward, copied)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = kwargs.get(PLAN_KWARG)
        if not isinstance(plan, DecodePlan) or torch.compiler.is_dynamo_compiling():
            return self.original(*args, **kwargs)  # eager calls, and the whole step traced through this layer
        device = plan.q_pos.device.type
        if device not in self._compiled:
            self._compiled[device] = self.step.variant(device).layers[self.slot.kind]
        fn = self._compiled[device]
        i = self.slot.pool
        kwargs[PLAN_KWARG] = plan._replace(keys=plan.keys[i], values=plan.values[i])  # this layer's pools only
        rows, width = plan.q_pos.shape
        shape = (device, rows > 1, width > 1)
        if shape not in self._shapes:  # the graph of this shape class is compiled with dynamic dimensions
            _mark_dynamic([*args, *(v for k, v in kwargs.items() if k != PLAN_KWARG)], rows, width)
            self._shapes.add(shape)
        return fn(self.slot.layer, *args, **kwargs)
