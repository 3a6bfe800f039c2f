"""What an OpenAI request body asks of ``hf-accel serve``: its fields read into engine keywords, checked.

Every field of a completions / chat completions body is either honoured, accepted because it cannot change the
output (``user``, ``metadata``, ...), or answered with a 400 that names it: a field the server does not implement
(``tools``, ``response_format`` other than text, ...) and an unknown field alike, as OpenAI's own API
answers, so a client never gets an answer that silently ignored what it asked for.

OpenAI's ``presence_penalty`` / ``frequency_penalty`` (counted over the completion's tokens, not the prompt's) and
``logit_bias`` are logits processors here; they run on the raw logits before temperature and top-p, as in OpenAI's
and vLLM's definitions. ``top_k``, ``min_p`` and ``repetition_penalty`` are taken as the extensions vLLM takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from .core.registry import rope_entries

__all__ = [
    "LogitBias",
    "OpenAIPenalties",
    "RequestError",
    "RequestOptions",
    "context_length",
    "message_text",
    "request_options",
]

#: fields that cannot change a completion: accepted and not used
_INERT = ("model", "prompt", "messages", "stream", "user", "metadata", "store", "service_tier", "prompt_cache_key",
          "safety_identifier", "parallel_tool_calls")  # fmt: skip
#: fields the server does not implement, with the values that ask for nothing (accepted)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}  # fmt: skip
_HONOURED = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "n", "seed", "presence_penalty",
             "frequency_penalty", "logit_bias", "response_format", "stream_options", "top_k", "min_p",
             "repetition_penalty", "logprobs", "top_logprobs", "echo")  # fmt: skip
#: the most alternatives per token ``logprobs`` / ``top_logprobs`` may ask for (OpenAI's chat limit)
MAX_LOGPROBS = 20


#: the most choices (``n``) one request may ask for: each is an engine request (and a worker thread while it streams)
MAX_CHOICES = 16


class RequestError(Exception):
    """A bad request: answered with ``status`` and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties: ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``,
    where ``count[j]`` is how often token ``j`` occurs among the generated tokens (those after ``prompt_len``)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]  # [B, generated]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones(out.shape, dtype=scores.dtype,
                                                                          device=scores.device))  # fmt: skip
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence  # [B, V]


class LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: a fixed number added to the logits of chosen tokens (-100 bans one, 100 forces it)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()  # [B, V]
        scores[:, self.ids.to(scores.device)] += self.values.to(scores.device, scores.dtype)
        return scores


@dataclass
class RequestOptions:
    """A request body's engine keywords (less the prompt-dependent processors: :meth:`kwargs_for`)."""

    kwargs: dict[str, Any]
    stops: list[str]
    include_usage: bool = False
    penalties: tuple[float, float] = (0.0, 0.0)  # presence, frequency
    logit_bias: dict[int, float] = field(default_factory=dict)
    limit_given: bool = False  # max_tokens was in the body (otherwise a default, cut to the context's room)
    n: int = 1  # choices: one engine request each
    logprobs: int | None = None  # alternatives per token with each token's log-probability (None: none asked)
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' log-probabilities) first

    def kwargs_for(self, prompt_len: int, context: int | None = None, prompt_field: str = "prompt") -> dict[str, Any]:
        """The engine keywords for a prompt of ``prompt_len`` tokens, on a model of ``context`` positions (``None``:
        unknown).

        Raises:
            RequestError: the prompt fills the context, or the prompt plus ``max_tokens`` passes it.
        """
        kwargs = dict(self.kwargs)
        if context is not None:
            room, asked = context - prompt_len, kwargs["max_new_tokens"]
            if room < 1:
                raise RequestError(f"the prompt has {prompt_len} tokens; this model's context holds {context}: "
                                   "shorten it", prompt_field, code="context_length_exceeded")  # fmt: skip
            if self.limit_given and asked > room:
                raise RequestError(f"a prompt of {prompt_len} tokens plus max_tokens={asked} passes this model's "
                                   f"context of {context} tokens: ask for at most {room}", "max_tokens",
                                   code="context_length_exceeded")  # fmt: skip
            kwargs["max_new_tokens"] = min(asked, room)
        processors = LogitsProcessorList()
        if any(self.penalties):
            processors.append(OpenAIPenalties(prompt_len, *self.penalties))
        if self.logit_bias:
            processors.append(LogitBias(self.logit_bias))
        return {**kwargs, "logits_processor": processors} if processors else kwargs


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float | None = None) -> float | None:
    """``body[name]`` as a float in ``[low, high]`` (``default`` when absent or null)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", name)
    if not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"'{name}' must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def _check_fields(body: dict[str, Any]) -> None:
    """400 for an unknown field or an unsupported one that asks for something."""
    for name, value in body.items():
        if name in _UNSUPPORTED:
            if not any(value == ok and type(value) is type(ok) for ok in _UNSUPPORTED[name]):
                raise RequestError(f"'{name}' is not supported by hf-accel serve", name)
        elif name not in _INERT and name not in _HONOURED:
            raise RequestError(f"unrecognized request field '{name}' (hf-accel serve takes the OpenAI fields "
                               f"{', '.join(_HONOURED)})", name)  # fmt: skip
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError("only response_format {'type': 'text'} is supported (no JSON mode or schemas)",
                           "response_format")  # fmt: skip


def _stops(body: dict[str, Any]) -> list[str]:
    stops = body.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    return [s for s in stops if s]


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Temperature, top-p and the vLLM-style extensions as ``generate`` keywords."""
    temperature = _number(body, "temperature", 0.0, math.inf, default=1.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k, min_p = _integer(body, "top_k", -1, 2**31 - 1), _number(body, "min_p", 0.0, 1.0)
    repetition = _number(body, "repetition_penalty", 0.0, math.inf)
    if top_p == 0.0 or repetition == 0.0:
        name = "top_p" if top_p == 0.0 else "repetition_penalty"
        raise RequestError(f"'{name}' must be > 0", name)
    kwargs: dict[str, Any] = {} if repetition is None else {"repetition_penalty": repetition}
    if temperature == 0:
        return {**kwargs, "do_sample": False}
    kwargs.update(do_sample=True, temperature=temperature, top_k=max(top_k or 0, 0))  # OpenAI: no top-k by default
    if top_p is not None:
        kwargs["top_p"] = top_p
    if min_p is not None:
        kwargs["min_p"] = min_p
    return kwargs


def _logit_bias(body: dict[str, Any], vocab: int) -> dict[int, float]:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else -1
        if not 0 <= token < vocab:
            raise RequestError(f"'logit_bias' key {key!r} is not a token id of this model (0..{vocab - 1})",
                               "logit_bias")  # fmt: skip
        out[token] = _number({"logit_bias": value}, "logit_bias", -100.0, 100.0)
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Alternatives per token asked for: chat's ``logprobs: true`` + ``top_logprobs: k``; completions'
    ``logprobs: k``."""
    if not chat:
        return None if body.get("logprobs") is False else _integer(body, "logprobs", 0, MAX_LOGPROBS)
    wanted, k = body.get("logprobs"), _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"'logprobs' must be a boolean, got {wanted!r}", "logprobs")
    if k is not None and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (k or 0) if wanted else None


def request_options(body: dict[str, Any], vocab: int, chat: bool = False) -> RequestOptions:
    """Read a completions / chat completions ``body`` (a model of ``vocab`` tokens) into :class:`RequestOptions`.

    Raises:
        RequestError: an unknown or unsupported field, or a value out of its range.
    """
    _check_fields(body)
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), 256)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise RequestError("'max_tokens' must be an integer >= 1", "max_tokens")
    stream_options = body.get("stream_options")
    if stream_options is not None and (not body.get("stream") or not isinstance(stream_options, dict)):
        raise RequestError("'stream_options' is an object, allowed only with stream=true", "stream_options")
    kwargs: dict[str, Any] = {"max_new_tokens": limit, **_sampling(body)}
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    if seed is not None:
        kwargs["seed"] = seed
    stops = _stops(body)
    if stops:
        kwargs["stop_strings"] = stops
    penalties = (_number(body, "presence_penalty", -2.0, 2.0, 0.0), _number(body, "frequency_penalty", -2.0, 2.0, 0.0))
    given = any(body.get(k) is not None for k in ("max_completion_tokens", "max_tokens"))
    usage = bool((stream_options or {}).get("include_usage"))
    choices, logprobs = _integer(body, "n", 1, MAX_CHOICES) or 1, _logprobs(body, chat)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    bias, echo = _logit_bias(body, vocab), body.get("echo")
    if echo not in (None, False, True) or (echo and chat):
        raise RequestError("'echo' is a boolean of /v1/completions", "echo")
    return RequestOptions(kwargs, stops, usage, penalties, bias, given, choices, logprobs, bool(echo))  # type: ignore[arg-type]


def context_length(config: Any) -> int | None:
    """The positions a model of ``config`` was trained for (``max_position_embeddings``), or ``None`` where rotary
    scaling changes its reach (yarn, dynamic, longrope, ...: a server then checks nothing)."""
    if any(str(e.get("rope_type", e.get("type", "default"))) != "default" for e in rope_entries(config)):
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) else None


def message_text(message: Any, index: int) -> dict[str, Any]:
    """A chat message with its content as one string: OpenAI's list of text parts is joined (with newlines, as
    vLLM does for text-only models); other parts (images, audio) are refused."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{index}] must be an object with a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return message
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"messages[{index}].content: only text parts are supported (this server serves a "
                               "text-only model)", "messages")  # fmt: skip
        return {**message, "content": "\n".join(texts)}
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts", "messages")
