"""One ``generate`` call on a :class:`~.cache.PagedCache`: before, during and after Transformers' loop.

Before: the cache starts a new batch (dropping the previous one) and adopts cached prompt prefixes. When
``generate`` will expand each prompt (``num_return_sequences`` or beams), the shared prompt is prefilled
once and its block table forked per copy, so the copies share K/V instead of recomputing it.
During: a logits processor that never changes scores watches the sequences: after the prefill it publishes
the prompt blocks (prefix cache); a row that has produced EOS gives its blocks back while the rest go on.
After: the full blocks of finished sequences are published for later calls.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..core.call import eos_token_ids
from ..core.errors import IncompatibleOptionsError
from .cache import PagedCache

__all__ = ["PagedRowTracker", "run_paged"]


class PagedRowTracker(LogitsProcessor):
    """Publishes prompt blocks after prefill and releases rows that finished on EOS. Scores pass unchanged.

    Args:
        cache: the call's cache.
        prompt_len: padded prompt length (tokens at or beyond it were generated).
        pads: left padding of each (expanded) row.
        eos: EOS token ids; empty disables early release.
        release: whether finished rows may give back their blocks (not for beam search, whose rows move).
    """

    def __init__(self, cache: PagedCache, prompt_len: int, pads: list[int], eos: list[int], release: bool) -> None:
        self.cache = cache
        self.prompt_len = prompt_len
        self.pads = pads
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.release = release and bool(eos)
        self._first = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._first:
            self._first = False
            for row in range(input_ids.shape[0]):  # (a cache without prefix reuse publishes nothing)
                self.cache.publish_row(row, input_ids[row, self.pads[row] :].tolist())
            return scores
        if self.release and input_ids.shape[1] > self.prompt_len:
            done = torch.isin(input_ids[:, -1].cpu(), self.eos).tolist()
            for row, finished in enumerate(done):
                if finished and not self.cache.released(row):
                    self.cache.release(row, input_ids[row, self.pads[row] :].tolist())
        return scores


def _generation_config(model: nn.Module, kwargs: dict[str, Any]) -> GenerationConfig:
    base = kwargs.get("generation_config") or model.generation_config
    cfg = copy.deepcopy(base)
    cfg.update(**{k: v for k, v in kwargs.items() if hasattr(cfg, k)})
    return cfg


def _eos_ids(cfg: GenerationConfig) -> list[int]:
    return eos_token_ids(cfg.eos_token_id)


def _attention_mask(ids: torch.Tensor, cfg: GenerationConfig, given: torch.Tensor | None) -> torch.Tensor:
    """The mask ``generate`` would use: the given one, else inferred from pad tokens as Transformers does."""
    if given is not None:
        return given
    pad, eos = cfg.pad_token_id, _eos_ids(cfg)
    if pad is not None and bool((ids == pad).any()) and pad not in eos:
        return ids.ne(pad).long()
    return torch.ones_like(ids)


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)


def _prefill_shared(model: nn.Module, cache: PagedCache, ids: torch.Tensor, mask: torch.Tensor, start: int) -> None:
    """Compute K/V of ``ids[:, start:-1]`` into the cache once (before the rows are forked)."""
    end = ids.shape[1] - 1
    if end <= start:
        return
    with torch.no_grad():
        model(
            input_ids=ids[:, start:end],
            attention_mask=mask[:, :end],
            position_ids=_position_ids(mask[:, :end])[:, start:end],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )


def _check_options(cfg: GenerationConfig) -> None:
    """Options a paged call cannot serve as Transformers would.

    Raises:
        IncompatibleOptionsError: ``cache_implementation`` (on the call's or the model's generation config),
            ``output_attentions`` (paged attention computes no weights), ``output_hidden_states`` (a prompt whose
            prefix comes from the cache, or one prefilled once for several sequences, has no hidden states there).
    """
    if cfg.cache_implementation is not None:
        raise IncompatibleOptionsError(
            f"generate(paged=...) brings its own cache, but the generation config sets cache_implementation="
            f"{cfg.cache_implementation!r} (model.generation_config or generation_config=); pass "
            "cache_implementation=None to this call, or drop paged="
        )
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(cfg, flag, False) and cfg.return_dict_in_generate:
            raise IncompatibleOptionsError(
                f"generate(paged=...) does not return {flag.removeprefix('output_')} (paged attention computes no "
                "attention weights, and a prompt prefix reused from the cache has no hidden states); call generate "
                f"without paged= for {flag}=True"
            )


def _row_tokens(mask: torch.Tensor, cfg: GenerationConfig, expand: int) -> list[int]:
    """Tokens each row of the call can hold: its real prompt plus what it may generate."""
    prompt = mask.shape[1]
    new = cfg.max_new_tokens if cfg.max_new_tokens is not None else max(0, (cfg.max_length or prompt) - prompt)
    return [int(n) + new for n in mask.sum(1).repeat_interleave(expand).tolist()]


def run_paged(model: nn.Module, cache: PagedCache, call: Any, proceed: Callable[[], Any]) -> Any:
    """Run one ``generate`` call (``call``: a :class:`~hf_accel.generate.GenerateCall`) on ``cache``.

    Raises:
        IncompatibleOptionsError: the cache was built for another model, or the call uses ``inputs_embeds``.
    """
    if not cache.belongs_to(model):
        raise IncompatibleOptionsError(
            "this PagedCache was built for another model; build one per model: hf_accel.PagedCache(model)"
        )
    with cache.serving():
        return _run(model, cache, call, proceed)


def _run(model: nn.Module, cache: PagedCache, call: Any, proceed: Callable[[], Any]) -> Any:
    ids = call.input_ids()
    if ids is None or "inputs_embeds" in call.kwargs:
        raise IncompatibleOptionsError("generate with a PagedCache needs input_ids (inputs_embeds are not supported)")
    cfg = _generation_config(model, call.kwargs)
    _check_options(cfg)
    mask = _attention_mask(ids, cfg, call.kwargs.get("attention_mask"))
    call.kwargs["attention_mask"] = mask
    beams = (cfg.num_beams or 1) > 1
    expand = (cfg.num_beams or 1) if beams else (cfg.num_return_sequences or 1)
    cache.reserve(_row_tokens(mask, cfg, expand), f"{mask.shape[0] * expand} rows x (prompt + max_new_tokens)")
    start = cache.start(ids, mask)
    if expand > 1:
        _prefill_shared(model, cache, ids, mask, start)
        cache.batch_repeat_interleave(expand)
    pads = (mask.shape[1] - mask.sum(1)).repeat_interleave(expand).tolist()
    # rows finished on EOS give their blocks back, unless the call returns per-step scores / logits: those of a
    # finished row go on (Transformers computes them over the row's full context) and must stay its own
    keep_rows = beams or bool(cfg.return_dict_in_generate and (cfg.output_scores or cfg.output_logits))
    tracker = PagedRowTracker(cache, ids.shape[1], pads, _eos_ids(cfg), release=not keep_rows)
    processors = call.kwargs.get("logits_processor") or LogitsProcessorList()
    call.kwargs["logits_processor"] = LogitsProcessorList([*processors, tracker])
    out = proceed()
    if not beams:
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new = sequences.shape[1] - mask.shape[1]
        full = torch.cat([mask.repeat_interleave(expand, 0), mask.new_ones(mask.shape[0] * expand, new)], 1)
        cache.publish(sequences, full.to(sequences.device))
    return out
