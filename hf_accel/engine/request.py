"""One engine request: its generation settings in Transformers' terms, and what it produced.

A request's keyword arguments are read exactly as ``generate`` reads them (``GenerationConfig`` fields, a
``generation_config``, ``logits_processor``, ``stopping_criteria``, ``streamer``), and Transformers builds the
logits processors (sampling warpers included) and stopping criteria (max length, EOS, stop strings), so each
request decodes as a batch-1 ``generate`` call would.
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..core.call import eos_token_ids
from ..core.errors import HFAccelError, IncompatibleOptionsError
from ..core.tokens import TokenBuffer
from ..speculative.strategies import PromptLookup

__all__ = [
    "FinishReason",
    "RequestFailedError",
    "RequestOutput",
    "RequestSpec",
    "TokenLogprob",
    "build_spec",
    "prompt_ids",
]

#: ``generate`` keywords a request takes besides ``GenerationConfig`` fields.
_EXTRA_KWARGS = (
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "streamer",
    "prompt_lookup",
    "speculative",
    "seed",
    "logprobs",
)


class FinishReason(str, enum.Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"  # a stop string or a user stopping criterion
    CANCELLED = "cancelled"
    FAILED = "failed"


class RequestFailedError(HFAccelError, RuntimeError):
    """Raised by :meth:`Engine.stream` / :meth:`RequestOutput.raise_for_error` for a request that failed alone."""


@dataclass
class RequestSpec:
    """A request's settings, resolved once when it is added."""

    config: GenerationConfig
    processors: LogitsProcessorList
    stopping: StoppingCriteriaList
    max_new_tokens: int
    sample: bool
    eos: list[int]
    lookup: PromptLookup | None
    streamer: Any
    #: plain greedy decoding: no logits processor, and stopping only where Transformers' max-length and EOS criteria
    #: would, given here as ``(max_length, eos ids)``; the engine then picks the token from the step's argmax and
    #: stops on the host (no per-request device round trip). ``None`` for every other request
    plain_stop: tuple[int, frozenset[int]] | None = None
    #: the request's own random source (``seed=``): its sampled tokens depend on its seed, not on the requests
    #: batched beside it or torch's global seed. ``None``: torch's global generator
    generator: torch.Generator | None = None
    #: ``logprobs=k``: each generated token's log-probability and the ``k`` likeliest alternatives (``None``: none)
    logprobs: int | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's own distribution at its position (the raw logits'
    log-softmax: before temperature, penalties, top-k / top-p), and the ``k`` likeliest tokens there.

    Args:
        token: the generated token id.
        logprob: its log-probability.
        top: ``(token id, log-probability)`` of the ``k`` likeliest tokens, likeliest first.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What a request produced.

    Args:
        request_id: the id :meth:`Engine.add_request` returned.
        prompt: prompt token ids.
        tokens: generated token ids.
        finish_reason: why it stopped (``None`` while running).
        error: the exception that failed it (``finish_reason == "failed"``).
        time_to_first_token / latency: seconds from :meth:`Engine.add_request` to its first token / to the end.
        preemptions: times it was preempted (its K/V recomputed later).
        proposed / accepted: speculative draft tokens proposed and accepted.
        logprobs: one :class:`TokenLogprob` per generated token (``add_request(logprobs=k)``; else ``None``).
    """

    request_id: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    time_to_first_token: float | None = None
    latency: float | None = None
    preemptions: int = 0
    proposed: int = 0
    accepted: int = 0
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def sequence(self) -> torch.Tensor:
        """``[prompt + generated]`` as a 1D int64 tensor (what ``generate`` returns per row, without padding)."""
        return torch.tensor([*self.prompt, *self.tokens], dtype=torch.long)

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise RequestFailedError(f"request {self.request_id} failed: {self.error!r}") from self.error


@dataclass
class Tracked:
    """Engine-side bookkeeping of one request (timing, and its ids so far as a growing tensor)."""

    output: RequestOutput
    spec: RequestSpec
    added_at: float = field(default_factory=time.perf_counter)
    collected: bool = False
    ids: TokenBuffer = field(init=False)

    def __post_init__(self) -> None:
        prompt = self.output.prompt
        self.ids = TokenBuffer(prompt, capacity=len(prompt) + self.spec.max_new_tokens)

    def emit(self, token: int, logprob: TokenLogprob | None = None) -> None:
        out = self.output
        if out.time_to_first_token is None:
            out.time_to_first_token = time.perf_counter() - self.added_at
        if logprob is not None:  # before the token: a reader that sees token i finds its entry
            out.logprobs = [] if out.logprobs is None else out.logprobs
            out.logprobs.append(logprob)
        out.tokens.append(token)
        self.ids.append(token)
        if self.spec.streamer is not None:
            self.spec.streamer.put(torch.tensor([token]))

    def close(self, reason: FinishReason, error: BaseException | None = None) -> None:
        out = self.output
        out.finish_reason, out.error = reason, error
        out.latency = time.perf_counter() - self.added_at
        if self.spec.streamer is not None and error is None:
            self.spec.streamer.end()


def _lookup(value: Any) -> PromptLookup | None:
    if value is None or value is False:
        return None
    if value is True:
        return PromptLookup()
    if isinstance(value, PromptLookup):
        return value
    raise IncompatibleOptionsError(
        f"the engine speculates with prompt lookup only: pass prompt_lookup=True or speculative=PromptLookup(...), "
        f"got {type(value).__name__}"
    )


def build_spec(
    model: nn.Module, prompt_len: int, kwargs: dict[str, Any], tokenizer: Any, device: torch.device
) -> RequestSpec:
    """Resolve a request's ``generate``-style keyword arguments.

    Raises:
        IncompatibleOptionsError: unknown keywords or invalid values (``max_new_tokens=0``, ``seed="x"``), beam
            search, several return sequences, stop strings without a tokenizer, or no room to generate.
    """
    kwargs = dict(kwargs)
    base = kwargs.pop("generation_config", None) or model.generation_config
    user_processors = kwargs.pop("logits_processor", None) or LogitsProcessorList()
    user_stopping = kwargs.pop("stopping_criteria", None) or StoppingCriteriaList()
    streamer = kwargs.pop("streamer", None)
    lookup = _lookup(kwargs.pop("speculative", None)) or _lookup(kwargs.pop("prompt_lookup", None))
    generator = _generator(kwargs.pop("seed", None), device)
    logprobs = kwargs.pop("logprobs", None)
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise IncompatibleOptionsError(f"logprobs must be an int >= 0 (alternatives per token), got {logprobs!r}")
    cfg, max_new = _resolve_config(model, base, kwargs, prompt_len)
    if cfg.stop_strings and tokenizer is None:
        raise IncompatibleOptionsError(
            f"stop_strings={cfg.stop_strings!r} need a tokenizer: create the engine as Engine(model, tokenizer)"
        )
    try:  # Transformers checks values as it builds the processors (e.g. temperature > 0): typed here
        model._prepare_special_tokens(cfg, True, device=device)
        processors = model._get_logits_processor(
            generation_config=cfg,
            input_ids_seq_length=prompt_len,
            encoder_input_ids=None,
            prefix_allowed_tokens_fn=None,
            logits_processor=user_processors,
            device=device,
            model_kwargs={},
        )
        stopping = model._get_stopping_criteria(cfg, user_stopping, tokenizer)
    except IncompatibleOptionsError:
        raise
    except ValueError as exc:
        raise IncompatibleOptionsError(f"invalid generation options: {exc}") from None
    sample = bool(cfg.do_sample)
    return RequestSpec(
        config=cfg,
        processors=processors,
        stopping=stopping,
        max_new_tokens=max_new,
        sample=sample,
        eos=eos_token_ids(cfg.eos_token_id),
        lookup=lookup,
        streamer=streamer,
        plain_stop=None if sample or len(processors) else _plain_stop(stopping),
        generator=generator,
        logprobs=logprobs,
    )


def _generator(seed: Any, device: torch.device) -> torch.Generator | None:
    """A request's own random source on ``device``, seeded with ``seed`` (``None``: none, the global one)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise IncompatibleOptionsError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    return torch.Generator(device=device).manual_seed(seed)


def _plain_stop(stopping: StoppingCriteriaList) -> tuple[int, frozenset[int]] | None:
    """``(max_length, eos ids)`` of stopping criteria that are only Transformers' max-length and EOS checks
    (``None`` where any other criterion, a stop string or a user's, needs the ids)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    limit, eos = 1 << 62, set()
    for criterion in stopping:
        if type(criterion) is MaxLengthCriteria:
            limit = min(limit, int(criterion.max_length))
        elif type(criterion) is EosTokenCriteria:
            eos.update(int(t) for t in criterion.eos_token_id.flatten().tolist())
        else:
            return None
    return limit, frozenset(eos)


def _resolve_config(
    model: nn.Module, base: GenerationConfig, kwargs: dict[str, Any], prompt_len: int
) -> tuple[GenerationConfig, int]:
    """The request's generation config (``base`` updated by ``kwargs``) and how many tokens it may generate."""
    cfg = copy.deepcopy(base)
    # unset fields as generate fills them: the model's generation config, then Transformers' defaults (max_length 20)
    cfg.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    cfg.update(**cfg._get_default_generation_params(), defaults_only=True)
    new = kwargs.get("max_new_tokens")
    if new is not None and (isinstance(new, bool) or not isinstance(new, int) or new < 1):
        raise IncompatibleOptionsError(f"max_new_tokens must be an int >= 1, got {new!r}")
    try:
        unknown = cfg.update(**kwargs)
        cfg.validate()
    except ValueError as exc:  # Transformers' own checks of the values (typed here, as the docs promise)
        raise IncompatibleOptionsError(f"invalid generation options: {exc}") from None
    if unknown:
        raise IncompatibleOptionsError(
            f"unknown generation options {sorted(unknown)}: a request takes GenerationConfig fields and "
            f"{', '.join(_EXTRA_KWARGS)}"
        )
    if (cfg.num_beams or 1) > 1 or (cfg.num_return_sequences or 1) > 1:
        raise IncompatibleOptionsError(
            "the engine decodes one sequence per request: num_beams and num_return_sequences must be 1 "
            "(add the prompt several times for several samples)"
        )
    if cfg.max_new_tokens is not None:
        cfg.max_length = prompt_len + cfg.max_new_tokens
    max_new = cfg.max_length - prompt_len
    if max_new < 1:
        raise IncompatibleOptionsError(
            f"max_length={cfg.max_length} leaves no room after a prompt of {prompt_len} tokens; set max_new_tokens"
        )
    return cfg, max_new


def prompt_ids(prompt: Any, tokenizer: Any, vocab: int) -> list[int]:
    """One request's prompt as token ids: a string (through ``tokenizer``), a list of ints, or a 1D / ``[1, L]``
    tensor.

    Raises:
        IncompatibleOptionsError: a text prompt without a tokenizer, another shape or type, an empty prompt, ids
            outside ``0..vocab-1``.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise IncompatibleOptionsError("a text prompt needs a tokenizer: Engine(model, tokenizer)")
        prompt = tokenizer(prompt)["input_ids"]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise IncompatibleOptionsError(
                f"a prompt tensor must be 1D or [1, L] (one request each), got shape {tuple(prompt.shape)}"
            )
        prompt = prompt.tolist()
    if not isinstance(prompt, Sequence) or not all(isinstance(t, int) for t in prompt):
        raise IncompatibleOptionsError(f"a prompt is a string, a list of token ids or a tensor, got {prompt!r:.80}")
    if len(prompt) == 0:
        raise IncompatibleOptionsError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise IncompatibleOptionsError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    return list(prompt)
