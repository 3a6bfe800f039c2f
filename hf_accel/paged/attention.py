"""Paged attention as a Transformers attention implementation (plus its mask function).

``register(base)`` adds ``"hf_accel_paged:<base>"`` to ``AttentionInterface`` and ``AttentionMaskInterface``
(done by :func:`hf_accel.patch_model`, never at import). ``base`` is the implementation the model used
before (``"sdpa"``, ``"eager"``, ...): whenever the K/V do not come from a :class:`~.cache.PagedCache`
(no cache, a ``DynamicCache``, ...), the call goes to the base function with the base mask, unchanged (one
exception with the same result: ``sdpa`` with grouped K/V heads and a masked multi-query chunk on CPU runs
SDPA on the grouped heads instead of copying K/V per group, :mod:`.gqa`).

With a ``PagedCache``, the mask function returns a :class:`PagedMask` (the 2D padding mask, no 4D mask
is built); the attention function writes the chunk's real tokens into the pool and then attends:

* decode-sized chunks (``Q <= DECODE_MAX_QUERY``) on CPU: the native kernel reads K/V straight from the
  pool through the block tables (no contiguous copy of the context); on CUDA the Triton kernel
  (:mod:`hf_accel.kernels.triton_paged`) does the same; elsewhere on accelerators (or with ``attention="batched"``)
  the portable implementation attends for the whole batch at once with every index on the device
  (:func:`hf_accel.kernels.portable.paged_attention`); neither reads the device on the host (CUDA-graph safe);
* prefill on an accelerator path (CUDA, or ``attention="batched"``) of a batch of fresh prompts: one masked SDPA
  call for the batch over the chunk's own K/V (:func:`hf_accel.kernels.portable.chunk_attention`);
* ``gather`` path (other prefill, or on request): per row, SDPA over the new tokens when the row had no context
  (nothing is gathered), else over the row's context gathered from the pool. This is also the reference the kernel
  is tested against.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleOptionsError
from ..kernels import flex_paged, portable
from ..kernels.ops import Choice, choose
from ..kernels.reference import dense_attention
from ..kernels.tuning import CPU
from .gqa import GQA_ATTENTION, gqa_attention, register_gqa, release_gqa
from .interface import acquire, release
from .layer import LAYER_TAG, PAGED_ATTENTION_PREFIX, PagedLayer, Scoring
from .plan import StepPlan

__all__ = [
    "DECODE_MAX_QUERY",
    "PagedMask",
    "attention_choice",
    "paged_name",
    "register",
    "step_attention",
    "unpaged_call",
    "unpaged_name",
    "unregister",
]

#: Chunks up to this many queries per row use the native kernel (decode, speculative verification).
DECODE_MAX_QUERY = CPU.paged_kernel_max_query
#: The native kernel handles blocks of up to this many tokens; larger blocks use the gather path.
KERNEL_MAX_BLOCK_SIZE = 64
#: ``forward`` keyword argument carrying a compiled decode step's :class:`~.compiled.DecodePlan` to attention.
PLAN_KWARG = "hf_accel_paged_plan"
DECODE_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def paged_name(base: str) -> str:
    return f"{PAGED_ATTENTION_PREFIX}{base}"


@dataclass
class PagedMask:
    """What the paged mask function hands every layer: the padding mask, and the base mask on demand.

    Args:
        padding: ``[B, kv_length]`` bool (True = real token), or ``None`` when there is no padding mask.
        base_fn / base_kwargs: the base implementation's mask function and its arguments, for layers whose
            K/V do not come from a ``PagedCache``.
    """

    padding: torch.Tensor | None
    base_fn: Callable[..., Any]
    base_kwargs: dict[str, Any]
    _base: Any = field(default=None, repr=False)
    _built: bool = field(default=False, repr=False)

    def base(self) -> Any:
        if not self._built:
            self._base, self._built = self.base_fn(**self.base_kwargs), True
        return self._base

    def chunk_padding(self, q_len: int) -> torch.Tensor | None:
        """``[B, Q]`` bool for the chunk being processed (the last ``q_len`` positions)."""
        return None if self.padding is None else self.padding[:, -q_len:]


#: whether the current thread's (or task's) ``generate`` call runs without a ``PagedCache``: its masks and attention
#: are then the base implementation's, while other threads' calls on the same model stay paged. Never read inside a
#: compiled region (only hf_accel's own compiled paged step builds masks there).
_UNPAGED: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_accel_unpaged", default=False)


@contextlib.contextmanager
def unpaged_call() -> Iterator[None]:
    """Inside it, this thread's model calls build the base implementation's masks (a call without a ``PagedCache``,
    e.g. one whose static cache has Transformers pre-build 4D masks); the shared model config is never changed."""
    token = _UNPAGED.set(True)
    try:
        yield
    finally:
        _UNPAGED.reset(token)


def _make_mask_function(base: str) -> Callable[..., PagedMask]:
    def paged_mask(**kwargs: Any) -> Any:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if not torch.compiler.is_dynamo_compiling() and _UNPAGED.get():
            return ALL_MASK_ATTENTION_FUNCTIONS[base](**kwargs)
        mask = kwargs.get("attention_mask")
        padding = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
        return PagedMask(padding=padding, base_fn=ALL_MASK_ATTENTION_FUNCTIONS[base], base_kwargs=kwargs)

    paged_mask.__name__ = f"paged_mask_{base}"
    return paged_mask


def _base_attention(module: nn.Module, base: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base != "eager" and base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise IncompatibleOptionsError(f"{type(module).__name__} has no eager_attention_forward to fall back to")
    return eager


def _make_attention_function(base: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def paged_attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        plan = kwargs.get(PLAN_KWARG)
        if plan is not None:  # a compiled decode step: the plan carries the pools (no cache in the graph)
            return _planned_attention(module, query, key, value, plan, scaling, kwargs), None
        # a compiled region without a plan is Transformers' own (a static cache): never a PagedCache's K/V
        layer: PagedLayer | None = None if torch.compiler.is_dynamo_compiling() else key.__dict__.get(LAYER_TAG)
        if layer is None:  # not a PagedCache: the base implementation (its result; K/V copies spared on CPU)
            mask = attention_mask.base() if isinstance(attention_mask, PagedMask) else attention_mask
            function = gqa_attention if base == "sdpa" else _base_attention(module, base)
            return function(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
        if attention_mask is not None and not isinstance(attention_mask, PagedMask):
            raise IncompatibleOptionsError("PagedCache takes no custom 4D attention mask; pass a 2D padding mask")
        # query: [B, H_q, Q, D]; key/value: [B, H_kv, Q, D] (this chunk only)
        batch, _, q_len, head_dim = query.shape
        padding = attention_mask.chunk_padding(q_len) if attention_mask is not None else None
        step = layer.cache.step_for(layer.layer_idx, batch, q_len, padding)
        layer.write(key, value, step)
        how = Scoring.of_call(kwargs, scaling, head_dim)
        if step.packed is not None:
            return attend_packed(layer, query, key, value, step, how), None
        return attend(layer, query, key, value, step, how), None  # [B, Q, H_q, D]

    paged_attention.__name__ = f"paged_attention_{base}"
    return paged_attention


def _planned_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: Any,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """One layer of a compiled decode step: ``hf_accel::paged_decode`` writes and attends; [B, Q, H_q, D]."""
    keys, values = plan.keys, plan.values
    if isinstance(keys, tuple):  # every layer's pools (the whole step); a regional step's layer gets its own
        keys, values = keys[module.layer_idx], values[module.layer_idx]
    how = Scoring.of_call(kwargs, scaling, query.shape[-1])
    return torch.ops.hf_accel.paged_decode(
        query, key, value, keys, values, plan.slots, plan.block_tables, plan.q_pos,
        how.scale, how.window, how.softcap, plan.attention, how.sinks,
    )  # fmt: skip


def unpaged_name(base: str) -> str:
    """The implementation a patched model runs without a ``PagedCache``: :data:`~.gqa.GQA_ATTENTION` for ``sdpa``
    (registered by :func:`register`), else ``base`` itself."""
    return GQA_ATTENTION if base == "sdpa" else base


def register(base: str) -> str:
    """Hold ``"hf_accel_paged:<base>"`` in Transformers' attention and mask interfaces for one more user (and, for
    ``sdpa``, :data:`~.gqa.GQA_ATTENTION`, see :func:`unpaged_name`); returns the paged name. :func:`unregister` gives
    them back (the last user removes them: :mod:`.interface`)."""
    if base.startswith(PAGED_ATTENTION_PREFIX):
        raise IncompatibleOptionsError(f"attention implementation {base!r} is already hf_accel's paged attention")
    name = paged_name(base)
    acquire(name, lambda: _make_attention_function(base), lambda: _make_mask_function(base))
    if base == "sdpa":
        register_gqa()
    return name


def unregister(base: str) -> None:
    """Undo one :func:`register` of ``base``."""
    release(paged_name(base))
    if base == "sdpa":
        release_gqa()


def attention_choice(mode: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int) -> Choice:
    """How decode-sized chunks attend over a pool (the rule shared by eager and compiled steps): the native
    ``paged_attention`` build (:func:`hf_accel.kernels.ops.choose`) where it takes the pool, else the gather path.

    Args:
        mode: the cache's ``attention`` option: ``"auto"``, ``"kernel"``, ``"batched"``, ``"flex"`` or ``"gather"``.
        device / dtype / block_size / head_dim: the pool's.

    Raises:
        IncompatibleOptionsError: ``mode="kernel"`` where no native build takes the pool; ``mode="flex"`` where
            FlexAttention is not compiled (:func:`hf_accel.kernels.flex_paged.why_not`).
    """
    choice = choose("paged_attention", device, dtype=dtype, block_size=block_size, head_dim=head_dim)
    if mode == "batched":
        return Choice(choice.op, f"{device.type}/portable", portable.paged_attention,
                      "PagedCache(attention='batched') asked for it (the implementation accelerators run)",
                      {choice.impl: "not asked for", **choice.rejected})  # fmt: skip
    if mode == "flex":
        return _flex_choice(choice, device)
    if mode == "gather":
        return Choice(choice.op, "gather", gather_attention, "PagedCache(attention='gather') asked for it",
                      {choice.impl: "not asked for", **choice.rejected})  # fmt: skip
    if mode == "kernel" and not choice.native:
        raise IncompatibleOptionsError(
            f"PagedCache(attention='kernel') needs a native paged-attention build for {dtype} pools of blocks of "
            f"{block_size} on {device} (head_dim {head_dim}), but: "
            + "; ".join(f"{k}: {v}" for k, v in choice.rejected.items())
            + "; use attention='auto'"
        )
    if not choice.native:
        return Choice(choice.op, "gather", gather_attention, "no native build takes this pool", choice.rejected)
    return choice


def _flex_choice(choice: Choice, device: torch.device) -> Choice:
    """``attention="flex"``: FlexAttention over the pool (:mod:`hf_accel.kernels.flex_paged`) where Inductor compiles
    it, else an error that says what to use."""
    why = flex_paged.why_not(device)
    if why is not None:
        raise IncompatibleOptionsError(f"PagedCache(attention='flex') cannot run on {device}: {why}")
    return Choice(choice.op, f"{device.type}/flex", flex_paged.paged_attention, flex_paged.WHY,
                  {choice.impl: "not asked for", **choice.rejected})  # fmt: skip


def step_attention(choice: Choice) -> str:
    """What a compiled step's ``hf_accel::paged_decode`` runs for the cache's :func:`attention_choice`:
    ``"native"`` (a CPU build), ``"triton"``, ``"portable"``, ``"flex"`` or ``"reference"`` (the gather path's maths,
    for the whole batch)."""
    if choice.impl.endswith("/portable"):
        return "portable"
    if choice.impl.endswith("/flex"):
        return "flex"
    if choice.impl == "cuda/triton":
        return "triton"
    return "native" if choice.impl.startswith("cpu/") else "reference"


def _accelerator_path(layer: PagedLayer) -> bool:
    """Whether the layer's decode attention is an accelerator's (Triton, FlexAttention or portable): prefill then
    batches too."""
    return step_attention(layer.attention) in ("portable", "triton", "flex")


def _use_kernel(layer: PagedLayer, query: torch.Tensor) -> bool:
    if query.shape[2] > DECODE_MAX_QUERY:
        return False  # long chunks: the gather path's dense attention is faster
    return layer.attention.native


def attend(
    layer: PagedLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: StepPlan,
    how: Scoring,
) -> torch.Tensor:
    """Attention of ``query`` ([B, H_q, Q, D]) over each row's stored context; returns [B, Q, H_q, D].

    ``key``/``value`` ([B, H_kv, Q, D]) are this chunk's own K/V, already written to the pool; rows with no
    earlier context attend over them directly instead of reading them back.
    """
    if _use_kernel(layer, query):
        t = step.tensors(layer.device)
        return _kernel_attention(layer, query, t["block_tables"], t["q_pos"], how)
    if all(step.fresh) and _accelerator_path(layer):
        # fresh prompts on an accelerator path: one call for the batch, over the chunk's own K/V (nothing is read back)
        q_pos = step.tensors(layer.device)["q_pos"]
        return portable.chunk_attention(query, key, value, q_pos, *how.args)
    return gather_attention(layer, query, key, value, step, how)


def _kernel_attention(
    layer: PagedLayer,
    query: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
    how: Scoring,
) -> torch.Tensor:
    """The native kernel over the pool: ``query`` [B, H_q, Q, D], ``q_pos`` [B, Q] (-1: padding) -> [B, Q, H_q, D]."""
    return layer.attention.fn(query, layer.keys, layer.values, block_tables, q_pos, *how.args)


def _attend_row(
    layer: PagedLayer,
    step: StepPlan,
    row: int,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: list[int],
    how: Scoring,
) -> torch.Tensor:
    """One row's queries ``q`` [H_q, r, D] at ``positions``: over its own new K/V (``k_new``/``v_new``
    [H_kv, r, D]) when the chunk is its whole context (a fresh prompt: nothing is read back), else over its
    context gathered from the pool. Returns [H_q, r, D]."""
    k, v = (k_new, v_new) if step.fresh[row] else layer.context(row, step)
    return dense_attention(q, k, v, positions, *how.args)


def attend_packed(
    layer: PagedLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: StepPlan,
    how: Scoring,
) -> torch.Tensor:
    """Attention of a packed chunk (``query`` ``[1, H_q, N, D]``: several sequences' tokens back to back).

    Rows feeding few tokens (decode, verification) go through the native kernel together, padded to the longest
    of them (only inside attention: the rest of the model ran on the ``N`` real tokens); on an accelerator path the
    prompt chunks that start their sequences attend together in one call over their own K/V; other prompt chunks
    attend one by one over their own slice (a fresh prompt) or their context gathered from the pool. Returns
    ``[1, N, H_q, D]``.
    """
    packed = step.packed
    q_all = query[0].transpose(0, 1)  # [N, H_q, D]
    out = torch.empty_like(q_all)
    rest = range(len(packed.lengths))
    if packed.short:
        t = packed.tensors(query.device)  # integer indices only: nothing here waits for the device
        q = q_all[t["index"]].permute(0, 2, 1, 3)  # [Rs, H_q, Qs, D]
        if _use_kernel(layer, q):
            o = _kernel_attention(layer, q, t["tables"], t["q_pos"], how)  # [Rs, Qs, H_q, D]
            _scatter_real(out, o, t)
            done = set(packed.short)
            rest = [r for r in rest if r not in done]
    fresh = tuple(r for r in rest if step.fresh[r])
    if fresh and _accelerator_path(layer):  # prompts from position 0: one call for all of them
        _attend_fresh(packed.rows_tensors(query.device, fresh), query, key, value, out, how)
        rest = [r for r in rest if not step.fresh[r]]
    for row in rest:
        start, n = packed.offsets[row], packed.lengths[row]
        chunk = slice(start, start + n)
        positions = step.q_pos[row, :n].tolist()
        q, k, v = query[0][:, chunk], key[0][:, chunk], value[0][:, chunk]
        o = _attend_row(layer, step, row, q, k, v, positions, how)  # [H_q, n, D]
        out[chunk] = o.transpose(0, 1).to(out.dtype)
    return out[None]


def _attend_fresh(
    t: dict[str, torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    how: Scoring,
) -> None:
    """Packed prompt chunks that start their sequences, padded into one batch (``t``: :meth:`PackedRows.rows_tensors`)
    and attended in one call over their own K/V; results scattered into ``out`` ``[N, H_q, D]``."""
    q = query[0].transpose(0, 1)[t["index"]].permute(0, 2, 1, 3)  # [R, H_q, W, D]
    k = key[0].transpose(0, 1)[t["index"]].permute(0, 2, 1, 3)  # [R, H_kv, W, D]
    v = value[0].transpose(0, 1)[t["index"]].permute(0, 2, 1, 3)
    _scatter_real(out, portable.chunk_attention(q, k, v, t["q_pos"], *how.args), t)


def _scatter_real(out: torch.Tensor, o: torch.Tensor, t: dict[str, torch.Tensor]) -> None:
    """Put the real tokens of padded rows ``o`` ``[R, W, H_q, D]`` at their chunk positions in ``out`` ``[N, H_q, D]``
    (``t``: :meth:`PackedRows.tensors` / :meth:`PackedRows.rows_tensors`' ``real_flat`` and ``real_at``)."""
    o = o.reshape(-1, *o.shape[2:]).index_select(0, t["real_flat"])  # [T, H_q, D]
    out.index_copy_(0, t["real_at"], o.to(out.dtype))


def gather_attention(
    layer: PagedLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    step: StepPlan,
    how: Scoring,
) -> torch.Tensor:
    """The explicitly named fallback: per row, gather the context from the pool and attend densely.

    A row whose chunk is its whole context (a fresh prefill) attends over the chunk's K/V; nothing is gathered.
    """
    batch, heads, q_len, dim = query.shape
    out = query.new_zeros(batch, q_len, heads, dim)
    for row in range(batch):
        pos = step.q_pos[row]
        real = (pos >= 0).nonzero().flatten()
        if real.numel() == 0:
            continue
        idx = real.to(query.device)
        k_new, v_new = key[row][:, idx], value[row][:, idx]  # [H_kv, r, D]
        o = _attend_row(layer, step, row, query[row][:, idx], k_new, v_new, pos[real].tolist(), how)
        out[row, idx] = o.transpose(0, 1).to(out.dtype)  # o: [H_q, r, D]
    return out
