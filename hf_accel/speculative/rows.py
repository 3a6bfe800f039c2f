"""Per-row bookkeeping of a speculative batch and the rules the loop applies per row (no model code).

:class:`Rows` keeps, per row, what plain decoding's ``input_ids`` would hold (the padded prompt, then the generated
tokens) and the row's real tokens, both as growing tensors (:class:`~hf_accel.core.tokens.TokenBuffer`), so the
stopping criteria and logits processors read views at every emitted token instead of a rebuilt sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..core.errors import IncompatibleOptionsError
from ..core.metrics import StepClock
from ..core.protocols import RowRollback
from ..core.registry import rope_entries
from ..core.tokens import TokenBuffer

__all__ = [
    "Rows",
    "check_cache",
    "check_left_padding",
    "finished_rows_go_on",
    "length_following_rope",
    "per_row_criteria",
    "rope_refusal",
    "row_independent",
    "scoreless",
    "widen",
]


class Rows:
    """Per-row sequences of the batch: the padded prompt, the real tokens, and what was generated.

    Args:
        input_ids: ``[B, P]`` the prompts as given (left padded).
        mask: ``[B, P]`` their padding mask.
        max_length: the call's ``max_length`` (room reserved for each row's tokens).
    """

    def __init__(self, input_ids: torch.Tensor, mask: torch.Tensor, max_length: int) -> None:
        check_left_padding(input_ids, mask)
        self.prompt = input_ids  # [B, P]
        self.real = [row[m.bool()].cpu() for row, m in zip(input_ids, mask, strict=True)]  # [L_i] each
        self.generated: list[list[int]] = [[] for _ in range(input_ids.shape[0])]
        self.done = [False] * input_ids.shape[0]
        room = max(max_length, input_ids.shape[1]) + 1
        device = input_ids.device
        self._ids = [TokenBuffer(row.tolist(), capacity=room, device=device) for row in input_ids]
        self._seq = [TokenBuffer(real.tolist(), capacity=room) for real in self.real]

    def append(self, row: int, token: int) -> None:
        """Row ``row`` generated ``token``."""
        self.generated[row].append(token)
        self._ids[row].append(token)
        self._seq[row].append(token)

    def ids(self, row: int, extra: Sequence[int] = ()) -> torch.Tensor:
        """``[1, P + g + len(extra)]``: what plain decoding's ``input_ids`` holds for this row (a view without
        ``extra``)."""
        ids = self._ids[row].view()
        if extra:
            ids = torch.cat([ids, torch.tensor(list(extra), dtype=torch.long, device=ids.device)])
        return ids[None]

    def sequence(self, row: int) -> torch.Tensor:
        """The row's real tokens so far (prompt without padding, then generated), ``[L]`` on CPU (a view)."""
        return self._seq[row].view()


def check_left_padding(input_ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Speculation keeps each row's real tokens as the mask's trailing ones (left padding, as ``generate`` expects
    for decoder-only models).

    Raises:
        IncompatibleOptionsError: a mask whose shape is not ``input_ids``'s, right padding or holes in a row.
    """
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise IncompatibleOptionsError(
            f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}: give one mask "
            "entry per token"
        )
    m = mask.bool()  # [B, P]
    # a left-padded row is 0...0 1...1: never a 1 followed by a 0
    bad = (m[:, :-1] & ~m[:, 1:]).any(1).nonzero().flatten().tolist() if m.shape[1] > 1 else []
    if bad:
        raise IncompatibleOptionsError(
            f"speculative generation needs left-padded prompts: row {bad[0]} of attention_mask has padding after a "
            "token (right padding or a hole); set tokenizer.padding_side = 'left'"
        )


def widen(budgets: list[int], rooms: list[int]) -> list[int]:
    """Every drafting row's budget raised to the widest one (within its room): the verification chunk is as wide as
    its widest row and computes the narrower rows' padding anyway, and a model draft feeds the whole batch until its
    widest row is done, so the extra guesses cost nothing and may be accepted. Rows not drafting this step (budget 0:
    paused, finished) stay at 0."""
    widest = max(budgets, default=0)
    return [min(widest, room) if b > 0 else 0 for b, room in zip(budgets, rooms, strict=True)]


@functools.cache
def _row_independent_types() -> tuple[type, ...]:
    import transformers.generation.logits_process as lp

    names = [
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "TopHLogitsWarper",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "InfNanRemoveLogitsProcessor",
        "RepetitionPenaltyLogitsProcessor",
    ]
    return tuple(getattr(lp, n) for n in names if hasattr(lp, n))


def row_independent(processor: Any) -> bool:
    """Whether ``processor`` treats every row alone (no per-batch-index state): it may then be called on one row.

    Others (user processors, prefix constraints, a repetition penalty with a per-row prompt length) are called
    on the full original batch with the row replicated, and the row is read back at its own index.
    """
    if not isinstance(processor, _row_independent_types()):
        return False
    return not isinstance(getattr(processor, "prompt_ignore_length", None), torch.Tensor)


def _has_sliding_layers(cache: Any) -> bool:
    return any(getattr(layer, "sliding_window", None) for layer in getattr(cache, "layers", []))


def check_cache(model: nn.Module, cache: Any, max_length: int) -> None:
    if isinstance(cache, RowRollback):  # hf_accel's PagedCache: per-row rollback, any window
        return
    if _is_static(cache) or not hasattr(cache, "crop"):
        raise IncompatibleOptionsError(
            "speculative generation needs a cache that can roll back (DynamicCache or hf_accel.PagedCache), "
            f"got {type(cache).__name__} (cache_implementation=, set in the call, generation_config= or "
            "model.generation_config): pass cache_implementation=None to this call, or paged=True"
        )
    window = getattr(model.config, "sliding_window", None)
    if _has_sliding_layers(cache) and window is not None and max_length > window:
        raise IncompatibleOptionsError(
            f"speculative generation past the sliding window ({max_length} > {window} tokens) needs the paged "
            "cache: pass paged=True (Transformers' sliding-window cache layers cannot roll back there)"
        )


def _is_static(cache: Any) -> bool:
    from transformers import StaticCache

    return isinstance(cache, StaticCache)


@functools.cache
def _scoreless_criteria() -> tuple[type, ...]:
    from transformers.generation import stopping_criteria as sc

    names = ("MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria", "StopStringCriteria")
    return tuple(getattr(sc, n) for n in names if hasattr(sc, n))


def scoreless(criterion: Any) -> bool:
    """Whether a stopping criterion never reads the scores (the screened head computes none): Transformers' length,
    time, EOS and stop-string criteria, or one that says so with ``reads_scores = False``."""
    return type(criterion) in _scoreless_criteria() or getattr(criterion, "reads_scores", True) is False


def per_row_criteria(criteria: Any) -> list[Any]:
    """The stopping criteria that may finish rows at different steps: all but length and time (and hf_accel's step
    clock), which stop every row together or never."""
    from transformers import MaxLengthCriteria, MaxTimeCriteria

    return [c for c in criteria or () if not isinstance(c, (MaxLengthCriteria, MaxTimeCriteria, StepClock))]


def finished_rows_go_on(criteria: Any) -> bool:
    """Whether Transformers' decoding goes on generating a row that a stopping criterion among ``criteria`` finished
    (a stop string, a caller's criterion): it pads finished rows only where an EOS criterion is among them, and
    otherwise keeps every row's real tokens until all rows have finished. Speculative generation stops computing a
    finished row, so a batch's outputs would differ."""
    return bool(per_row_criteria(criteria)) and not any(hasattr(c, "eos_token_id") for c in criteria or ())


def length_following_rope(config: Any) -> list[tuple[str, int]]:
    """``(rope_type, limit)`` of each rotary embedding of ``config`` whose frequencies follow the length of the longest
    sequence in a forward (Transformers' ``dynamic`` scaling: recomputed at every step past ``max_position_embeddings``;
    ``longrope``: long factors once a forward passes ``original_max_position_embeddings``); empty for the others."""
    found = []
    for entry in rope_entries(config):
        kind = str(entry.get("rope_type", entry.get("type", "default")))
        if "dynamic" in kind:
            limit = getattr(config, "max_position_embeddings", None)
        elif kind == "longrope":
            limit = entry.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
        else:
            continue
        if limit is not None:
            found.append((kind, int(limit)))
    return found


def rope_refusal(config: Any, prompt_len: int, max_length: int) -> str | None:
    """Why speculation cannot reproduce plain decoding's tokens for a call of ``prompt_len`` to ``max_length`` tokens
    (``None``: it can), as far as the rotary embedding decides: one whose frequencies follow the length of the longest
    sequence in each forward (:func:`length_following_rope`) gives a verification chunk other frequencies than
    one-token steps would. A ``longrope`` call that starts past its switch is exact."""
    for kind, limit in length_following_rope(config):
        if "dynamic" in kind and max_length > limit:
            return (
                f"the rotary embedding (rope_type {kind!r}) recomputes its frequencies at every step past {limit} "
                f"tokens, so verification chunks would see other ones than one-token steps (this call may reach "
                f"{max_length}): keep max_length <= {limit}, or decode without speculation"
            )
        if kind == "longrope" and prompt_len <= limit < max_length:
            return (
                f"the rotary embedding (rope_type 'longrope') switches to its long factors once a forward passes "
                f"{limit} tokens, which this call crosses ({prompt_len} -> {max_length}) at another step in a "
                f"verification chunk than one token at a time: keep max_length <= {limit}, or decode without "
                "speculation"
            )
    return None
