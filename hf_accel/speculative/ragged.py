"""Rows that advance by different numbers of tokens, over one Transformers cache.

Each row of a speculative batch accepts a different number of draft tokens per step. :class:`RaggedCache`
keeps them all in one cache without throwing work away: the logical layout is shared (one
``attention_mask`` of shape ``[B, T]``), and a row's rejected tokens become holes (mask 0) that no later
token attends to. ``position_ids`` count each row's *real* tokens, so a row computes exactly what it would
alone. After a rollback the cache is cropped to the longest row, so holes stay within one step's width.

With a :class:`~hf_accel.paged.cache.PagedCache`, holes are never stored at all: the pool keeps each row's
real tokens and a rollback truncates each row's block table (:meth:`PagedCache.rollback_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.protocols import RowRollback
from ..kernels.tuning import CPU
from ..native.apply import NativeForward

__all__ = ["LEAN_MAX_WIDTH", "RaggedCache"]

#: Widest chunk a ``step`` function runs (a draft's steps, catch-ups and guess checks)
LEAN_MAX_WIDTH = CPU.lean_max_width


class RaggedCache:
    """A cache plus the ragged layout of its rows.

    Args:
        model: the causal LM whose forward fills the cache.
        cache: a Transformers ``Cache`` (``DynamicCache``) or a ``PagedCache``, possibly holding a cached prefix.
        mask: ``[B, T0]`` the layout of what the cache will hold after the first :meth:`feed` (the prompt's
            padding mask); the first feed passes the tokens the cache lacks.
        step: runs feeds of up to ``LEAN_MAX_WIDTH`` tokens instead of the model's forward (a draft's
            :class:`~hf_accel.native.step.LeanStep`, or the target's for its verification chunks), and prompts too
            where it has a ``takes_prompt(cache, mask cells)`` that says so; not with a ``PagedCache``.
    """

    def __init__(
        self, model: nn.Module, cache: Any, mask: torch.Tensor, step: Callable[..., torch.Tensor] | None = None
    ) -> None:
        self.model = model
        self.cache = cache
        self.mask = mask.long()  # [B, T]: 1 = real token, 0 = padding / hole
        self.paged = isinstance(cache, RowRollback)
        # (ids, mask, positions, cache, last, hidden) -> [B, C or last, V or E]
        self.step = None if self.paged else step

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    def real_lengths(self) -> torch.Tensor:
        return self.mask.sum(1)  # [B]

    def feed(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor | None = None,
        prefix: bool = False,
        last: int = 0,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Run the model on a chunk and return its logits.

        Args:
            ids: ``[B, C]`` tokens; pad entries are anything.
            valid: ``[B, C]`` bool, False for holes (default: all real). Ignored with ``prefix``.
            prefix: the chunk is the tail of ``self.mask``'s initial layout (the prompt not yet cached).
            last: only the last ``last`` columns' logits are needed (1: a prompt, a catch-up); the LM head skips
                the rest. 0: every column's.
            hidden: return the final hidden states instead (the decoder ``model.model`` runs, not the LM head; for
                a target whose logits are ``lm_head(hidden)``, see :mod:`.screen`).

        Returns:
            ``[B, C, V]`` logits, or ``[B, last, V]``; with ``hidden``, ``[B, C or last, E]``.
        """
        if prefix:
            mask = self.mask
            chunk = mask[:, -ids.shape[1] :]
        else:
            chunk = (valid if valid is not None else torch.ones_like(ids, dtype=torch.bool)).long()
            mask = torch.cat([self.mask, chunk.to(self.mask.device)], 1)
        before = (mask[:, : mask.shape[1] - ids.shape[1]]).sum(1, keepdim=True)  # [B, 1] real tokens already in
        pos = (before + chunk.cumsum(1) - 1).clamp_min(0)  # [B, C] each real token's index in its row
        if self.step is not None and self._steps(ids.shape[1], prefix):
            out = self.step(ids, mask, pos, self.cache, last=last, hidden=hidden)  # [B, C or last, V or E]
            self.mask = mask
            return out
        if hidden:
            states = self._hidden(ids, mask, pos)  # [B, C, E]
            self.mask = mask
            return states[:, -last:] if last else states
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=last,
        )
        self.mask = mask
        return out.logits

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The decoder's final hidden states of a chunk: through the native feature's paged executor where it takes
        the chunk (the paged cache), else ``model.model`` (the decoder without the LM head)."""
        kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True)
        forward = vars(self.model).get("forward")
        if isinstance(forward, NativeForward) and self.paged:
            states = forward.hidden_states(**kwargs)
            if states is not None:
                return states
        return self.model.model(**kwargs).last_hidden_state

    def _steps(self, width: int, prefix: bool) -> bool:
        """Whether ``step`` runs a chunk: up to ``LEAN_MAX_WIDTH`` tokens, or a prompt where the step takes one."""
        if prefix:
            takes = getattr(self.step, "takes_prompt", None)
            return takes is not None and bool(takes(self.cache, self.mask.numel() * width))
        return width <= LEAN_MAX_WIDTH

    def rollback(self, drop: Sequence[int]) -> None:
        """Forget the last ``drop[i]`` real tokens of each row, then crop the layout to the longest row."""
        if not any(drop):
            return
        mask = self.mask.clone()
        for row, n in enumerate(drop):
            if n:
                real = mask[row].nonzero().flatten()
                mask[row, real[len(real) - n :]] = 0
        last = mask.flip(1).argmax(1)  # distance of each row's last real token from the end
        width = mask.shape[1] - int(last.min())
        remove = mask.shape[1] - width
        if self.paged:
            self.cache.rollback_rows(list(drop), remove)
        elif remove:
            self.cache.crop(-remove)
        self.mask = mask[:, :width]

    def select(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch and stop costing compute)."""
        index = torch.tensor(list(keep), dtype=torch.long)
        self.cache.batch_select_indices(index.to(self.mask.device))
        self.mask = self.mask[index.to(self.mask.device)]
        # columns that are now holes in every row are dead weight; they stay until the next crop

    def settle(self, prompt_mask: torch.Tensor, generated: Sequence[int]) -> str:
        """Leave the cache as Transformers' own decoding leaves it, for a caller who keeps it (a multi-turn chat
        passing it back): every row's K/V of the call's sequences but their last token, in the sequences' layout
        (the prompt's left padding, then the generated tokens; no holes, nothing past the end).

        Rows that stopped at different lengths cannot be laid out so: Transformers' cache holds K/V of the padding
        it fed a finished row, which no speculative step computed. Then, and for cache layers that cannot be
        re-laid (sliding windows), the cache is emptied instead: passed back, it makes the next call recompute the
        whole sequence (the same tokens, a longer prefill), never attend to stale or missing K/V.

        Args:
            prompt_mask: ``[B, P]`` the call's attention mask (the layout's first ``P`` columns).
            generated: tokens each row generated.

        Returns:
            What was done: ``"kept"`` or ``"emptied: <why>"`` (``SpeculativeStats.cache``).
        """
        if self.batch != prompt_mask.shape[0] or min(generated, default=0) != max(generated, default=0):
            return self._empty("rows stopped at different lengths")
        width = prompt_mask.shape[1] + max(generated) - 1  # a continuation's cache: all but the last token
        mask = self.mask.bool()  # [B, T]
        cols = torch.arange(mask.shape[1], device=mask.device)  # [T]
        pads = (prompt_mask.shape[1] - prompt_mask.sum(1)).to(mask.device)  # [B]: each row's left padding
        rank = mask.long().cumsum(1)  # [B, T]: 1-based rank of each real column in its row
        keep = (cols[None] < pads[:, None]) | (mask & (rank <= (width - pads)[:, None]))  # [B, T]
        if mask.shape[1] < width or not bool((keep.sum(1) == width).all()):
            return self._empty("its layout lacks tokens of the sequences")
        if bool(keep[:, :width].all()):  # no holes before the end: a crop
            if mask.shape[1] > width:
                self.cache.crop(width - mask.shape[1])
        elif not self._gather(keep.nonzero()[:, 1].view(-1, width)):
            return self._empty("holes in a cache layer that cannot be re-laid (a sliding window)")
        grown = torch.ones(mask.shape[0], width - prompt_mask.shape[1], dtype=torch.long, device=mask.device)
        self.mask = torch.cat([prompt_mask.long().to(mask.device), grown], 1)  # [B, width]
        return "kept"

    def _gather(self, index: torch.Tensor) -> bool:
        """Re-lay every layer's K/V as ``index`` ``[B, W]`` (each row's kept columns, in order) says; ``False``
        (nothing changed) where a layer is not a plain full-attention ``DynamicLayer`` of the layout's width."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        layers = getattr(self.cache, "layers", None) or []
        width = self.mask.shape[1]
        for layer in layers:
            plain = isinstance(layer, DynamicLayer) and not isinstance(layer, DynamicSlidingWindowLayer)
            keys = getattr(layer, "keys", None)
            if not plain or keys is None or keys.dim() != 4 or keys.shape[-2] != width:
                return False
        for layer in layers:
            k = layer.keys  # [B, H_kv, T, D]
            where = index.to(k.device)[:, None, :, None].expand(k.shape[0], k.shape[1], -1, k.shape[3])
            layer.keys, layer.values = k.gather(2, where), layer.values.gather(2, where)  # [B, H_kv, W, D]
        return bool(layers)

    def _empty(self, why: str) -> str:
        self.cache.reset()
        self.mask = self.mask[:, :0]
        return f"emptied: {why}"
