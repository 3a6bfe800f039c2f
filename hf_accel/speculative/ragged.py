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
