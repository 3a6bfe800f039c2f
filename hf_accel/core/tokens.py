"""A token sequence that grows in place, so per-token consumers (stopping criteria, logits processors) read a view
instead of a tensor rebuilt from the whole sequence at every token."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["TokenBuffer"]


class TokenBuffer:
    """Token ids in a preallocated int64 tensor that doubles when full: appending is amortised O(1) and
    :meth:`view` copies nothing.

    Args:
        tokens: the first tokens.
        capacity: room to reserve up front (e.g. prompt + ``max_new_tokens``).
        device: where the tensor lives.
    """

    def __init__(self, tokens: Iterable[int] = (), capacity: int = 0, device: torch.device | str = "cpu") -> None:
        first = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
        self._buf = torch.empty(max(capacity, first.numel(), 16), dtype=torch.long, device=device)
        self._buf[: first.numel()] = first
        self._n = first.numel()

    def __len__(self) -> int:
        return self._n

    def _room(self, extra: int) -> None:
        if self._n + extra > self._buf.numel():
            bigger = torch.empty(max(2 * self._buf.numel(), self._n + extra), dtype=torch.long, device=self._buf.device)
            bigger[: self._n] = self._buf[: self._n]
            self._buf = bigger

    def append(self, token: int) -> None:
        self._room(1)
        self._buf[self._n] = token
        self._n += 1

    def extend(self, tokens: Iterable[int]) -> None:
        values = torch.as_tensor(list(tokens), dtype=torch.long)
        self._room(values.numel())
        self._buf[self._n : self._n + values.numel()] = values
        self._n += values.numel()

    def view(self) -> torch.Tensor:
        """``[n]`` int64: the tokens so far (a view: later appends do not change it, a reallocation never moves it)."""
        return self._buf[: self._n]
