"""A compiled decode step over the :class:`~.cache.PagedCache` (the ``compile`` feature's paged part).

It serves one-token decode steps and short chunks whose every logit is needed (speculative verification).

The eager paged path plans each forward inside attention (block allocation, the K/V tag on ``update``'s
output): Python that ``torch.compile`` cannot trace. The compiled step moves that bookkeeping out of the graph:

1. before the forward, in Python, :meth:`~.cache.PagedCache.decode_plan` allocates the step's slots and builds
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
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .._ext import define_op
from .attention import DECODE_MAX_QUERY, PLAN_KWARG, dense_attention, kernel_usable, native_kernel
from .cache import PagedCache
from .layer import uses_paged_attention
from .plan import token_slots

__all__ = ["CompiledPagedDecode", "DecodePlan", "define_paged_op"]


class DecodePlan(NamedTuple):
    """One compiled step's plan (``Q`` new tokens per row), passed to every layer's attention (on its device).

    Args:
        slots: ``[B*Q]`` int64 pool slot of each new token (row-major); -1 for a token not stored (a released
            row, a hole).
        block_tables: ``[B, MB]`` int32.
        q_pos: ``[B, Q]`` int32 index of each new token in its sequence; -1 for a token not stored.
        keys / values: every layer's K and V pool, ``[num_blocks, block_size, H_kv, D]`` each.
        kernel: attend with the native kernel (else the gather reference).
    """

    slots: torch.Tensor
    block_tables: torch.Tensor
    q_pos: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    kernel: bool


def _write(pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``new`` ([B, H_kv, Q, D]) at ``slots`` ([B*Q], -1 = skip) of ``pool`` ([NB, BS, H_kv, D])."""
    rows = new.transpose(1, 2).reshape(-1, *pool.shape[2:])  # [B*Q, H_kv, D]
    keep = slots >= 0
    if not bool(keep.all()):
        rows, slots = rows[keep], slots[keep]
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, rows.to(pool.dtype))


def table_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """Reference attention over the pool through block tables (what the native kernel computes).

    Shapes: query ``[B, H_q, Q, D]``; pools ``[NB, BS, H_kv, D]``; block_tables ``[B, MB]``; q_pos ``[B, Q]``
    (-1 = padding, which gets zeros). Returns ``[B, Q, H_q, D]``.
    """
    batch, heads, q_len, dim = query.shape
    block = k_pool.shape[1]
    out = query.new_zeros(batch, q_len, heads, dim)
    flat_k, flat_v = k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:])  # [NB*BS, H_kv, D]
    for row in range(batch):
        pos = q_pos[row]
        real = (pos >= 0).nonzero().flatten()
        if real.numel() == 0:
            continue
        slots = token_slots(block_tables[row], int(pos.max()) + 1, block)  # [n]
        k = flat_k.index_select(0, slots).transpose(0, 1)  # [H_kv, n, D]
        v = flat_v.index_select(0, slots).transpose(0, 1)
        o = dense_attention(query[row][:, real], k, v, pos[real].tolist(), scale, window, softcap)  # [H_q, r, D]
        out[row, real] = o.transpose(0, 1).to(out.dtype)
    return out


def _paged_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    kernel: bool,
) -> torch.Tensor:
    # query: [B, H_q, Q, D]; key/value: [B, H_kv, Q, D] -> [B, Q, H_q, D]
    _write(k_pool, key, slots)
    _write(v_pool, value, slots)
    if kernel:
        return native_kernel().paged_attention(  # type: ignore[union-attr]
            query, k_pool, v_pool, block_tables, q_pos, scale, window, softcap
        )
    return table_attention(query, k_pool, v_pool, block_tables, q_pos, scale, window, softcap)


def _paged_decode_fake(query, key, value, k_pool, v_pool, slots, block_tables, q_pos, scale, window, softcap, kernel):
    b, h, q, d = query.shape  # shapes only, for tracing
    return query.new_empty((b, q, h, d))


def define_paged_op() -> Callable[..., torch.Tensor]:
    """Define ``torch.ops.hf_accel.paged_decode`` once per process (called at patch time, never at import)."""
    schema = (
        "(Tensor query, Tensor key, Tensor value, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
        "Tensor block_tables, Tensor q_pos, float scale, int window, float softcap, bool kernel) -> Tensor"
    )
    return define_op("paged_decode", schema, _paged_decode, _paged_decode_fake)


#: ``forward`` keyword arguments the compiled step understands; any other (labels, output_attentions,
#: inputs_embeds, ...) sends the call to the eager forward.
_STEP_KWARGS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "return_dict", "logits_to_keep"}
)


class CompiledPagedDecode:
    """A model's ``forward`` (bound on the instance) that runs paged decode steps and verification chunks compiled.

    Args:
        model: the patched model (paged attention already switched on).
        compile_kwargs: arguments for ``torch.compile``.

    A call runs compiled when it feeds ``[B, 1]`` ``input_ids`` (a decode step), or ``[B, W]`` with
    ``W <= DECODE_MAX_QUERY`` and every position's logits (a speculative verification chunk), with a
    :class:`PagedCache` (not pinned by the engine) and only the keyword arguments ``generate`` uses for a decode
    step; everything else (prompts, long chunks, other options) goes to the original ``forward`` unchanged.
    """

    def __init__(self, model: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        self.model = model
        self.original = types.MethodType(type(model).forward, model)
        # dynamo keeps graphs (and its recompile limit, 8) per code object, and each model's graphs guard on that
        # model: with one shared ``_step`` the ninth patched model of a process would fall back to eager (or fail
        # with fullgraph). Each instance therefore compiles its own copy of the code.
        fn = CompiledPagedDecode._step
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        self.step_code = own.__code__  # the code object whose graphs belong to this model (tests count them)
        self.compiled = torch.compile(types.MethodType(own, self), **compile_kwargs)
        self.steps = 0  # compiled steps run (for tests and reports)
        functools.update_wrapper(self, self.original)  # generate inspects forward's signature

    def __deepcopy__(self, memo: dict[int, object]) -> Any:
        copied = memo.get(id(self.model))  # a deep copy of the model gets its class's plain forward
        return None if copied is None else types.MethodType(type(copied).forward, copied)

    def _step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        out = self.original(
            input_ids=input_ids, position_ids=position_ids, cache=None, use_cache=False, **{PLAN_KWARG: plan}
        )
        return out.logits  # [B, W, V]

    def _paged_cache(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PagedCache | None:
        cache = kwargs.get("cache")
        ids = kwargs.get("input_ids")
        if args or not _STEP_KWARGS.issuperset(kwargs):
            return None
        if not isinstance(cache, PagedCache) or cache.pinned:  # pinned: the engine's packed chunks
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
        cache = self._paged_cache(args, kwargs)
        if cache is None:
            return self.original(*args, **kwargs)
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
        if tables.shape[1] < 2:  # a width of 1 would be specialised by the compiler (a second graph)
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
        kernel = kernel_usable(cache.attention, layers[0].device, cache.dtype, cache.block_size, cache.head_dim)
        plan = DecodePlan(
            slots, tables, q_pos, tuple(x.keys for x in layers), tuple(x.values for x in layers), kernel
        )  # fmt: skip
        logits = self.compiled(ids, position_ids, plan)
        self.steps += 1
        return CausalLMOutputWithPast(logits=logits, cache=cache)
