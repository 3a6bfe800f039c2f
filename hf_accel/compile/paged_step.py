"""A compiled decode step over the :class:`~hf_accel.PagedCache` (the ``compile`` feature's paged part).

It serves one-token decode steps and short chunks whose every logit is needed (speculative verification).

The eager paged path plans each forward inside attention (block allocation, the K/V tag on ``update``'s
output): Python that ``torch.compile`` cannot trace. The compiled step moves that bookkeeping out of the graph:

1. before the forward, in Python, :meth:`~hf_accel.PagedCache.decode_plan` allocates the step's slots and builds
   the block tables (the same plan the eager path makes at its first layer);
2. the model's own ``forward`` then runs compiled, with no Transformers cache at all (``cache=None``,
   ``use_cache=False``) and the plan as one extra keyword argument, which Transformers passes down to every
   attention call; the paged attention function hands it to the custom op ``hf_accel::paged_decode``, which
   writes the new K/V into that layer's pool and attends over it (native kernel on CPU, a gather reference
   elsewhere). The op is opaque to Inductor, which compiles everything around it.

The plan's tensors are graph inputs, so the graph is reused across steps and ``generate`` calls; the batch,
the chunk width and the block-table width (it grows with the context) are dynamic dimensions. Prompts (which
want only the last logits), chunks longer than ``DECODE_MAX_QUERY`` and calls with options the step does not
cover run the original, eager forward.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..core.config import CompileConfig
from ..core.gate import SharedExclusiveGate
from ..paged.attention import DECODE_MAX_QUERY, PLAN_KWARG, step_attention
from ..paged.cache import PagedCache
from ..paged.layer import uses_paged_attention
from ..paged.step_op import DecodePlan
from .buckets import pad_step
from .regional import LayerSlot, compile_layers, own_code_copy

__all__ = ["CompiledPagedDecode"]


#: ``forward`` keyword arguments the compiled step understands; any other (labels, output_attentions,
#: inputs_embeds, ...) sends the call to the eager forward.
_STEP_KWARGS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "return_dict", "logits_to_keep"}
)


class CompiledPagedDecode:
    """A model's ``forward`` (bound on the instance) that runs paged decode steps and verification chunks compiled.

    Args:
        model: the patched model (paged attention already switched on).
        config: the compile options (:meth:`~hf_accel.CompileConfig.compile_kwargs`,
            :meth:`~hf_accel.CompileConfig.step_graphs`, :attr:`~hf_accel.CompileConfig.regional`).
        layers: the decoder layers (:func:`~.regional.layer_slots`), for a step compiled by region; their
            ``forward`` is bound to :class:`~.regional.RegionalLayer` by the caller.

    A call runs compiled when it feeds ``[B, 1]`` ``input_ids`` (a decode step), or ``[B, W]`` with
    ``W <= DECODE_MAX_QUERY`` and every position's logits (a speculative verification chunk), with a
    :class:`PagedCache` (not pinned by the engine) and only the keyword arguments ``generate`` uses for a decode
    step; everything else (prompts, long chunks, other options) goes to the original ``forward`` unchanged. The
    step is compiled per device type the model runs on (a model patched on the CPU and moved to CUDA gets the CUDA
    step: bucketed shapes and CUDA graphs).
    """

    def __init__(self, model: nn.Module, config: CompileConfig, layers: tuple[LayerSlot, ...] = ()) -> None:
        self.model = model
        self.config = config
        self.layers = layers
        self.original = types.MethodType(type(model).forward, model)
        self._variants: dict[str, _Variant] = {}
        self._lock = threading.Lock()
        # a call that may compile runs alone (torch's compile flag is process-wide: core/gate.py); others share it,
        # the model's draft models' calls included (core.gate.model_gate)
        self.gate = SharedExclusiveGate()
        self._ready: set[tuple[Any, ...]] = set()  # shape classes whose graphs exist (their calls share the gate)
        self.steps = 0  # compiled steps run (for tests and reports)
        functools.update_wrapper(self, self.original)  # generate inspects forward's signature

    def variant(self, device_type: str | None = None) -> _Variant:
        """The compiled step for a device type (the model's current one by default), built on first use."""
        device_type = device_type or next(self.model.parameters()).device.type
        with self._lock:
            found = self._variants.get(device_type)
            if found is None:
                found = self._variants[device_type] = _Variant.build(self, device_type)
        return found

    @property
    def static_shapes(self) -> bool:
        """Whether steps are padded to bucketed shapes (:mod:`.buckets`) on the model's current device."""
        return self.variant().static_shapes

    @property
    def graphs(self) -> bool:
        """Whether the model's current device captures the step in CUDA graphs."""
        return self.variant().graphs

    @property
    def regional(self) -> bool:
        """Whether the model's current device compiles the step by region (one graph per kind of decoder layer)."""
        return bool(self.variant().layers)

    @property
    def step_codes(self) -> tuple[types.CodeType, ...]:
        """The code objects whose graphs are this model's step on its current device (tests count them): the whole
        step's, or one per kind of decoder layer (regional)."""
        return self.variant().codes

    def __deepcopy__(self, memo: dict[int, object]) -> Any:
        copied = memo.get(id(self.model))  # a deep copy of the model gets its class's plain forward
        return None if copied is None else types.MethodType(type(copied).forward, copied)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        out = self.original(
            input_ids=input_ids, position_ids=position_ids, cache=None, use_cache=False, **{PLAN_KWARG: plan}
        )
        return out.logits  # [B, W, V]

    def run_rows(
        self,
        cache: PagedCache,
        ids: torch.Tensor,
        position_ids: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        q_pos: torch.Tensor,
    ) -> torch.Tensor:
        """One compiled step over planned rows: ``ids`` ``[B, W]``, ``position_ids`` ``[1 or B, W]``, ``slots``
        ``[B*W]``, ``tables`` ``[B, MB]``, ``q_pos`` ``[B, W]``, on the model's device (planned by
        :meth:`~hf_accel.PagedCache.decode_plan` for ``generate``'s steps, or :meth:`~hf_accel.PagedCache.rows_plan`
        for :class:`hf_accel.Engine`'s decode steps). Pads to buckets (static shapes) or marks the dimensions that
        vary as dynamic, then runs the compiled step. Returns logits ``[B, W, V]``."""
        rows, width = ids.shape
        variant = self.variant(ids.device.type)
        ids, position_ids = _dense(ids), _dense(position_ids)
        if variant.static_shapes:
            ids, position_ids, slots, tables, q_pos, _ = pad_step(ids, position_ids, slots, tables, q_pos)
            if variant.graphs:
                self._mark_static(cache)
        elif tables.shape[1] < 2:  # a width of 1 would be specialised by the compiler (a second graph)
            tables = torch.nn.functional.pad(tables, (0, 1))
        torch._dynamo.maybe_mark_dynamic(tables, 1)  # the table grows with the context: one graph for all widths
        for t in (ids, position_ids, slots, tables, q_pos):  # rows leave mid-call (speculative decoding's
            if t.shape[0] > 1:  # compaction) and calls differ in batch: one graph for every batch size > 1
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if width > 1:  # verification chunks of any width share one graph (width 1 keeps its own)
            for t in (ids, position_ids, q_pos):
                if t.shape[1] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 1)
        layers = cache.layers
        if cache.grows:  # a pool that grows keeps its graph: its block count is symbolic
            for x in layers:
                torch._dynamo.maybe_mark_dynamic(x.keys, 0)
                torch._dynamo.maybe_mark_dynamic(x.values, 0)
        attention = step_attention(layers[0].attention)  # the cache's choice, reported with the cache
        plan = DecodePlan(
            slots, tables, q_pos, tuple(x.keys for x in layers), tuple(x.values for x in layers), attention
        )  # fmt: skip
        logits = self._run(variant, ids, position_ids, plan, cache)
        if variant.static_shapes:  # the real rows; out of the graphs' buffers, which the next replay overwrites
            logits = logits[:rows].clone() if variant.graphs else logits[:rows]
        self.steps += 1
        return logits

    def _run(self, variant: _Variant, ids: torch.Tensor, position_ids: torch.Tensor, plan: DecodePlan,
             cache: PagedCache) -> torch.Tensor:  # fmt: skip
        """The compiled step, behind the gate (:meth:`_gated`) under its shape class."""
        rows, width = ids.shape
        shape = (rows, width, plan.block_tables.shape[1]) if variant.static_shapes else (rows > 1, width > 1)
        key = (ids.device.type, plan.keys[0].dtype, cache.grows, *shape)
        return self._gated(key, lambda: variant.compiled(ids, position_ids, plan))

    def _gated(self, key: tuple[Any, ...], call: Callable[[], Any]) -> Any:
        """``call()`` alone the first time its shape class ``key`` runs (it may compile: the step's graphs, compiled
        MLPs, FlexAttention), beside the model's other calls after that (:mod:`hf_accel.core.gate`)."""
        if key in self._ready:
            with self.gate.shared():
                return call()
        with self.gate.exclusive():
            out = call()
        self._ready.add(key)
        return out

    @staticmethod
    def _eager_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """An eager call's shape class: device, one row or more, one token or more (a prompt)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            return ("eager", "other")
        return ("eager", ids.device.type, ids.shape[0] > 1, ids.shape[1] > 1)

    def _mark_static(self, cache: PagedCache) -> None:
        """Tell the compiler the pools keep their addresses (CUDA graphs write them in place; a pool that moves, a
        grown one or another cache's, makes the graphs re-record, never recompile)."""
        for layer in cache.layers:
            torch._dynamo.mark_static_address(layer.keys, guard=False)
            torch._dynamo.mark_static_address(layer.values, guard=False)

    def _paged_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PagedCache | None:
        cache = kwargs.get("cache")
        ids = kwargs.get("input_ids")
        if args or not _STEP_KWARGS.issuperset(kwargs):
            return None
        if not isinstance(cache, PagedCache) or cache.pinned_plan is not None:  # pinned: the engine's packed chunks
            return None
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or kwargs.get("use_cache") is False:
            return None
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int) or kwargs.get("return_dict") is False:
            return None  # an index tensor of logits to keep, or a tuple output: leave those to the model
        width = ids.shape[1]
        if width != 1 and not (width <= DECODE_MAX_QUERY and keep == 0):
            return None  # prompts (last logits only) and long chunks run eagerly; verification chunks compiled
        return cache if uses_paged_attention(self.model) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():  # traced by a caller's compilation (Transformers' static cache)
            return self.original(*args, **kwargs)
        cache = self._paged_cache(args, kwargs)
        if cache is None:  # eager; its first call per shape class may compile too (compiled MLPs, FlexAttention)
            return self._gated(self._eager_key(args, kwargs), lambda: self.original(*args, **kwargs))
        from transformers.modeling_outputs import CausalLMOutputWithPast

        ids = kwargs["input_ids"]
        width = ids.shape[1]
        position_ids = kwargs.get("position_ids")
        if position_ids is None:  # what the model computes without them: the logical length
            start = cache.get_seq_length()
            position_ids = torch.arange(start, start + width, device=ids.device)[None]  # [1, W]
        mask = kwargs.get("attention_mask")
        padding = mask[:, -width:] if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None  # [B, W]
        slots, tables, q_pos = cache.decode_plan(ids.shape[0], padding, width)
        logits = self.run_rows(cache, ids, position_ids, slots, tables, q_pos)
        return CausalLMOutputWithPast(logits=logits, cache=cache)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy with the strides of a new tensor of its shape. The compiler guards on strides, those of
    dimensions of size 1 included: a caller's slice (``ids[:, -1:]`` of a ``[1, L]`` prompt) would otherwise compile
    another graph on every call whose strides differ."""
    expected, step = [], 1
    for size in reversed(t.shape):  # [B, W] -> (W, 1)
        expected.append(step)
        step *= max(size, 1)
    return t if t.stride() == tuple(reversed(expected)) else t.clone(memory_format=torch.contiguous_format)


class _Variant(NamedTuple):
    """One device type's compiled step: its function, the code objects holding its graphs, and how it runs."""

    compiled: Any
    codes: tuple[types.CodeType, ...]
    static_shapes: bool
    graphs: bool
    layers: dict[str, Any]  # regional: {layer kind: compiled layer forward}; empty when the step is compiled whole

    @staticmethod
    def build(step: CompiledPagedDecode, device_type: str) -> _Variant:
        static = step.config.step_graphs(device_type)
        kwargs = step.config.compile_kwargs(graphs=static and device_type == "cuda")
        graphs = static and device_type == "cuda" and kwargs.get("mode") in ("reduce-overhead", "max-autotune")
        if step.layers:  # regional (never with CUDA graphs): the model's forward eager, its layers compiled
            layers, codes = compile_layers(step.layers, kwargs)
            return _Variant(types.MethodType(CompiledPagedDecode._step, step), codes, static, False, layers)
        own = own_code_copy(CompiledPagedDecode._step)  # per instance and device type
        return _Variant(torch.compile(types.MethodType(own, step), **kwargs), (own.__code__,), static, graphs, {})
