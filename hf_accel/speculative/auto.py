"""Which plain ``generate`` calls speculate without a keyword (``SpeculativeConfig.auto``, set by the default patch on
the CPU): greedy calls whose outputs speculation reproduces exactly and whose options it supports; every other call
decodes as usual (the reason is kept in the call's notes and logged at DEBUG level)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..core.call import GenerateCall, eos_token_ids
from ..core.errors import IncompatibleOptionsError
from ..core.protocols import RowRollback
from ..native.apply import NativeForward
from .rows import check_left_padding, per_row_criteria, rope_refusal

__all__ = ["AUTO_NOTE", "auto_refusal", "memory_refusal"]

logger = logging.getLogger("hf_accel")
#: ``GenerateCall.notes`` key: why the call did not speculate automatically (absent when it did)
AUTO_NOTE = "speculative_auto_skipped"
_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _option(call: GenerateCall, model: nn.Module, name: str, default: Any) -> Any:
    """A generation option as this call sets it: a keyword, else its ``generation_config``, else the model's."""
    if name in call.kwargs:
        return call.kwargs[name]
    config = call.kwargs.get("generation_config") or getattr(model, "generation_config", None)
    value = getattr(config, name, default)
    return default if value is None else value


def auto_refusal(model: nn.Module, call: GenerateCall) -> str | None:
    """Why ``call`` must not speculate automatically (``None``: it may), beyond what an explicit speculative call
    refuses too (beam search, assisted-generation arguments, ``custom_generate``: ``speculative.apply``'s check)."""
    if _option(call, model, "do_sample", False):
        return "sampling (do_sample=True): speculation preserves the distribution, not a seed's exact tokens"
    asked = [name for name in _OUTPUTS if _option(call, model, name, False)]
    if asked:
        return f"{', '.join(asked)} asked for"
    if call.kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds instead of input_ids"
    if call.kwargs.get("logits_processor"):
        # speculation calls processors at every drafted position, rejected ones included: one that keeps state
        # across calls (counts them, runs a model of its own) would see calls plain decoding never makes
        return "a logits processor of the caller's (speculation calls it at every drafted position)"
    cache = call.kwargs.get("cache")
    if call.kwargs.get("past_key_values") is not None or _option(call, model, "cache_implementation", None):
        return "a cache chosen by the caller"  # the keyword, or the generation config's (static for compile)
    if cache is not None and not isinstance(cache, RowRollback):
        # the caller keeps it (a multi-turn chat): it gets the cache Transformers' own decoding leaves
        return f"a cache of the caller's ({type(cache).__name__})"
    if getattr(cache, "prefix_cache", False):
        return "a paged cache with prefix caching (speculative calls do not reuse cached prefixes)"
    if _option(call, model, "stop_strings", None) and call.kwargs.get("tokenizer") is None:
        return "stop_strings without tokenizer="
    return (
        _padding_refusal(model, call)
        or _stop_refusal(model, call)
        or _rope_refusal(model, call)
        or _cheap_target(model)
    )


def _stop_refusal(model: nn.Module, call: GenerateCall) -> str | None:
    """A batch whose rows a stop string or a caller's criterion may finish, without an EOS token: Transformers'
    decoding goes on generating a finished row there (:func:`~.rows.finished_rows_go_on`)."""
    ids = call.input_ids()
    rows = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1
    rows *= int(_option(call, model, "num_return_sequences", 1))
    given = list(call.kwargs.get("stopping_criteria") or ())
    eos = eos_token_ids(_option(call, model, "eos_token_id", None)) or any(hasattr(c, "eos_token_id") for c in given)
    if rows < 2 or eos or not (_option(call, model, "stop_strings", None) or per_row_criteria(given)):
        return None
    return "stop strings or a stopping criterion in a batch without an EOS token (a finished row goes on there)"


def _rope_refusal(model: nn.Module, call: GenerateCall) -> str | None:
    """:func:`~.rows.rope_refusal` for the call's prompt and the most tokens it may reach."""
    ids = call.input_ids()
    prompt = ids.shape[-1] if isinstance(ids, torch.Tensor) else 0
    new = _option(call, model, "max_new_tokens", None)
    limit = prompt + new if new is not None else _option(call, model, "max_length", 20)
    return rope_refusal(model.config, prompt, limit)


#: an automatic int8 self-draft must read at most this share of the bytes a target's step reads: a round of k drafts
#: and one verification pays where k draft steps cost less than the k target steps they replace. Measured on
#: SmolLM2-135M (benchmarks/bench_gguf.py, docs/log/2026-12-06-k-quants.md): over exact codes at shares 0.74
#: (Q4_K_M) to 0.89 (Q8_0) the draft gave 1.6-2.4x in decode; at 1.37 (the default model, 4-bit codes) it lost (95
#: against 142 tok/s). The int8 draft's kernel streams its bytes faster than the 8-bit coded one.
DRAFT_SHARE = 1.0


def _cheap_target(model: nn.Module) -> str | None:
    """Why the target's own decode steps are too cheap for an int8 draft to pay (``None``: they are not): the native
    executor running the weights from exact codes (mostly 4-bit) reads fewer bytes a step than an int8 copy would."""
    forward = vars(model).get("forward")
    step = forward.current_step() if isinstance(forward, NativeForward) else None
    if step is None or (step.head_codes is None and (step.native is None or step.native.coded is None)):
        return None
    read, weights = step.step_bytes()
    if weights <= DRAFT_SHARE * read:
        return None
    return (
        f"the target's steps read exact codes ({read / 1e6:.0f} MB a step): an int8 draft's steps (~{weights / 1e6:.0f}"
        f" MB) would cost about as much as the target steps they replace"
    )


def _inferred_mask(model: nn.Module, call: GenerateCall, ids: torch.Tensor) -> torch.Tensor | None:
    """The mask Transformers infers for a call without one: zeros at the pad token where it occurs and is not an
    end-of-sequence token (``eos_token_id=None`` makes a chat template's end token padding), else none."""
    pad = _option(call, model, "pad_token_id", None)
    if pad is None:
        return None
    pad = int(torch.as_tensor(pad).flatten()[0])
    eos = _option(call, model, "eos_token_id", None)
    if (eos is not None and pad in torch.as_tensor(eos).flatten().tolist()) or not bool((ids == pad).any()):
        return None
    return ids.ne(pad).long()


def _padding_refusal(model: nn.Module, call: GenerateCall) -> str | None:
    """Speculation takes left-padded rows only; Transformers' own decoding takes any mask (with a warning)."""
    ids, mask = call.input_ids(), call.kwargs.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return "no [batch, tokens] input_ids"
    mask = mask if mask is not None else _inferred_mask(model, call, ids)
    if mask is None:
        return None
    try:
        check_left_padding(ids, mask)
    except IncompatibleOptionsError as err:
        return str(err)
    return None


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        return None


def memory_refusal(model: nn.Module) -> str | None:
    """Why building a self-speculative int8 draft could strain memory (``None``: it fits): building copies the float
    weights once before quantizing them, so it wants twice the model's bytes free."""
    need = 2 * sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    free = _available_bytes()
    if free is not None and free < need:
        return f"the int8 draft's build needs ~{need >> 20} MiB free, {free >> 20} MiB available"
    return None
