"""``hf-accel serve``: an OpenAI-compatible HTTP server over an :class:`~hf_accel.Engine` on a patched model.

Endpoints (the shape of OpenAI's API, as ``transformers serve`` offers it): ``POST /v1/completions``,
``POST /v1/chat/completions`` (the tokenizer's chat template; ``stream=true`` sends server-sent events),
``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text). Requests are batched continuously by the
engine's background loop; a client that disconnects cancels its request; bad requests get OpenAI-style JSON errors
with a 4xx status. Needs the ``serve`` extra (FastAPI and uvicorn).
"""

import asyncio
import contextlib
import itertools
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import torch
from torch import nn

from .core.errors import HFAccelError
from .engine import Engine, FinishReason, RequestFailedError, TokenLogprob
from .engine.runner import token_logprobs
from .serve_options import RequestError, RequestOptions, context_length, message_text, request_options

__all__ = ["create_app", "serve"]

_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class TextTail:
    """Detokenizes a growing token list into text deltas: holds back an incomplete UTF-8 character and any tail
    that could be the start of a stop string, and cuts the text at the first stop string (OpenAI leaves it out).

    Each token costs a decode of a few recent tokens, not of the whole completion: the window from the tokens of
    the last complete piece (``_prefix``) to the end is decoded and compared with its decoded start (``_read``)
    (the offsets Text Generation Inference and vLLM use), so the leading-space rules of a tokenizer see the same
    context as in a full decode. :meth:`finish` decodes the whole completion once.
    """

    #: tokens a window may hold while its text ends in an incomplete character; past it the bytes are not valid
    #: UTF-8 at all and the replacement character is the text (a character is at most 4 bytes)
    WAIT = 8

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""  # the text of tokens[:_read]
        self.sent = 0  # characters handed out
        self._prefix = self._read = 0
        self._hold = max((len(s) - 1 for s in self.stops), default=0)  # may be the start of a stop string
        self._stopped = False

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def feed(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        if self._stopped:
            return ""
        before, after = self._decode(self._prefix, self._read), self._decode(self._prefix)
        waiting = after.endswith("\ufffd") and len(self.tokens) - self._read < self.WAIT
        if len(after) > len(before) and not waiting:
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
        cut = self._cut(self.text)
        if cut is not None:
            self._stopped = True
            return self._take(self.text, cut)
        return self._take(self.text, len(self.text) - self._hold)

    def finish(self) -> str:
        text = self._decode(0)
        cut = self._cut(text)
        return self._take(text, len(text) if cut is None else cut)

    def _cut(self, text: str) -> int | None:
        """Where the first stop string starts (none starts before ``sent``: the held-back tail covers it)."""
        found = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _take(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent : end], end
        return piece


def _one_prompt(body: dict[str, Any]) -> Any:
    """A completions body's ``prompt``, a batch of one (``["text"]``, ``[[ids]]``) taken as that one prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


class Echo(NamedTuple):
    """What ``echo`` puts before a completion: the prompt's text and its tokens' log-probability entries."""

    text: str
    entries: list[TokenLogprob]


class _Server:
    """What the endpoints share: the engine, the tokenizer and counters."""

    def __init__(self, engine: Engine, tokenizer: Any, name: str) -> None:
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.created = int(time.time())
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.generated = 0

    def prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if body.get("model") not in (None, self.name):
            raise RequestError(f"model {body.get('model')!r} does not exist; this server serves {self.name!r}",
                               "model", 404, "model_not_found")  # fmt: skip
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise RequestError("this model's tokenizer has no chat template: use /v1/completions", "messages")
            messages = [message_text(m, i) for i, m in enumerate(messages)]
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:
                raise RequestError(f"the chat template cannot render these messages: {exc}", "messages") from exc
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        prompt = _one_prompt(body)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt  # token ids (checked against the vocabulary by the engine)
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per request: "
                               "send several requests for several prompts)", "prompt")  # fmt: skip
        return list(self.tokenizer(prompt)["input_ids"])

    def start(self, body: dict[str, Any], chat: bool) -> tuple[list[int], RequestOptions]:
        """Read ``body`` and queue its ``n`` engine requests (one per choice; they share the prompt's K/V through
        the prefix cache): their ids and the options. Choice ``i`` of a seeded request samples with ``seed + i``."""
        config = self.engine.model.config.get_text_config()
        options = request_options(body, config.vocab_size, chat)
        ids = self.prompt(body, chat)
        kwargs = options.kwargs_for(len(ids), context_length(config), "messages" if chat else "prompt")
        rids: list[int] = []
        seed = kwargs.get("seed")
        try:
            for i in range(options.n):
                rids.append(self.submit(ids, kwargs if seed is None else {**kwargs, "seed": (seed + i) % 2**63}))
        except RequestError:
            for rid in rids:
                self.cancel(rid)
            raise
        return rids, options

    def submit(self, ids: list[int], kwargs: dict[str, Any]) -> int:
        try:
            return self.engine.add_request(ids, **kwargs)
        except HFAccelError as exc:
            self.counts["rejected"] += 1
            raise RequestError(str(exc)) from exc

    def finish_reason(self, rid: int) -> str:
        out = self.engine.result(rid)
        self.generated += len(out.tokens)
        if out.finish_reason == FinishReason.FAILED:
            self.counts["failed"] += 1
            raise RequestError(f"generation failed: {out.error!r}", status=500)
        self.counts["completed" if out.finish_reason != FinishReason.CANCELLED else "cancelled"] += 1
        return _FINISH.get(out.finish_reason, "stop")

    def echoed(self, body: dict[str, Any], rids: list[int], options: RequestOptions) -> Echo | None:
        """The prompt as ``echo`` returns it: its text and, with ``logprobs``, each prompt token's entry from one
        forward of the model (the first token's log-probability is unknown: NaN, written as null)."""
        if not options.echo:
            return None
        ids = self.engine.result(rids[0]).prompt
        prompt = _one_prompt(body)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        if options.logprobs is None:
            return Echo(text, [])
        with torch.no_grad():
            logits = self.engine.model(input_ids=torch.tensor([ids], device=self.engine.device)).logits[0, :-1]
        entries = token_logprobs(logits, ids[1:], options.logprobs) if len(ids) > 1 else []  # logits: [L - 1, V]
        return Echo(text, [TokenLogprob(ids[0], math.nan), *entries])

    def token_text(self, token: int) -> str:
        """One token as text (a piece of a multi-byte character reads as U+FFFD)."""
        return self.tokenizer.decode([token])

    def cancel(self, rid: int) -> None:
        if not self.engine.result(rid).finished:
            self.engine.cancel(rid)

    def metrics(self) -> str:
        e, stats = self.engine, self.engine.cache.stats()
        lines = [f'hf_accel_requests_total{{status="{k}"}} {v}' for k, v in self.counts.items()]
        lines += [
            f"hf_accel_requests_running {len(e.scheduler.running)}",
            f"hf_accel_requests_waiting {len(e.scheduler.waiting)}",
            f"hf_accel_engine_steps_total {e.steps}",
            f"hf_accel_forward_tokens_total {e.forward_tokens}",
            f"hf_accel_generated_tokens_total {self.generated}",
            f"hf_accel_kv_blocks_used {stats['blocks_used']}",
            f"hf_accel_kv_blocks_total {stats['blocks_total']}",
            f"hf_accel_prefix_hit_tokens_total {e.scheduler.prefix_hit_tokens}",
        ]
        return "\n".join(lines) + "\n"


def _chunk(
    server: _Server,
    rid: str,
    chat: bool,
    text: str | None,
    finish: str | None,
    first: bool,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> str:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    payload = {"id": rid, "object": obj, "created": int(time.time()), "model": server.name, "choices": [choice]}
    return f"data: {json.dumps(payload)}\n\n"


def _pump(server: _Server, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, rid: int) -> None:
    """Hand request ``rid``'s tokens to ``queue`` as ``(index, token, logprob entry or None, None)``, then
    ``(index, None, None, error)``."""
    error: BaseException | None = None
    out = server.engine.result(rid)
    try:
        for j, token in enumerate(server.engine.stream(rid)):
            entry = out.logprobs[j] if out.logprobs is not None else None  # appended before its token
            loop.call_soon_threadsafe(queue.put_nowait, (index, token, entry, None))
    except Exception as exc:  # handed to the response, which reports it
        error = exc
    loop.call_soon_threadsafe(queue.put_nowait, (index, None, None, error))


async def _events(
    server: _Server, rids: list[int], tails: list[TextTail], chat: bool, options: RequestOptions, echo: Echo | None
) -> AsyncIterator[str]:
    """Server-sent events of a request's choices, interleaved as their tokens come (each chunk names its choice's
    index); a disconnect (the task is cancelled) cancels the engine requests."""
    from starlette.concurrency import run_in_threadpool

    name = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    pumps = [asyncio.ensure_future(run_in_threadpool(_pump, server, loop, queue, i, r)) for i, r in enumerate(rids)]
    pending: list[list[TokenLogprob]] = [[] for _ in rids]  # entries of tokens not yet in a chunk
    asked = lambda entries: _logprobs(server, entries, chat) if options.logprobs is not None else None  # noqa: E731
    try:
        for i in range(len(rids) if chat else 0):
            yield _chunk(server, name, chat, None, None, first=True, index=i)
        if echo is not None:  # completions' echo: the prompt first, in every choice
            lp = asked(echo.entries)
            for i in range(len(rids)):
                yield _chunk(server, name, chat, echo.text, None, first=False, index=i, logprobs=lp)
        running = len(rids)
        while running:
            i, token, entry, error = await queue.get()
            if token is not None:
                pending[i] += [entry] if entry is not None else []
                piece = tails[i].feed([token])
                if piece:
                    lp = asked(pending[i])
                    pending[i] = []
                    yield _chunk(server, name, chat, piece, None, first=False, index=i, logprobs=lp)
                continue
            running -= 1
            try:
                if error is not None:
                    raise error
                rest, finish = tails[i].finish(), server.finish_reason(rids[i])
            except Exception as exc:  # the status line is sent: the error goes in the stream
                failure = exc if isinstance(exc, RequestError) else RequestError(f"generation failed: {exc}", None, 500)
                yield f"data: {json.dumps(failure.body())}\n\n"
                return
            lp = asked(pending[i])
            yield _chunk(server, name, chat, rest, finish, first=False, index=i, logprobs=lp)
        if options.include_usage:  # OpenAI's stream_options: a last chunk with no choices and the usage
            kind = "chat.completion.chunk" if chat else "text_completion"
            usage = {"id": name, "object": kind, "created": int(time.time()), "model": server.name, "choices": [],
                     "usage": _usage(server, rids)}  # fmt: skip
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for rid in rids:
            server.cancel(rid)
        await asyncio.gather(*pumps, return_exceptions=True)


def _logprobs(server: _Server, entries: list[TokenLogprob], chat: bool) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object of ``entries``: chat's ``content`` list, or completions' parallel lists."""
    text = server.token_text
    if chat:

        def item(token: int, logprob: float) -> dict[str, Any]:
            return {"token": text(token), "logprob": logprob, "bytes": list(text(token).encode())}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]}
                            for e in entries]}  # fmt: skip
    tokens = [text(e.token) for e in entries]
    offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]
    top = [None if math.isnan(e.logprob) else {text(t): v for t, v in e.top} for e in entries]  # echo's first: none
    return {"tokens": tokens, "token_logprobs": [None if math.isnan(e.logprob) else e.logprob for e in entries],
            "text_offset": offsets, "top_logprobs": top}  # fmt: skip


def _usage(server: _Server, rids: list[int]) -> dict[str, int]:
    """OpenAI's usage of a request: its prompt once, the tokens of every choice."""
    prompt = len(server.engine.result(rids[0]).prompt)
    completion = sum(len(server.engine.result(rid).tokens) for rid in rids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _complete(
    server: _Server,
    rids: list[int],
    tails: list[TextTail],
    chat: bool,
    request: Any,
    options: RequestOptions,
    echo: Echo | None,
) -> dict[str, Any]:
    """Wait for every choice (all cancelled if the client goes away meanwhile); the response body."""
    from starlette.concurrency import run_in_threadpool

    streams = [run_in_threadpool(lambda rid=rid: list(server.engine.stream(rid))) for rid in rids]
    work = asyncio.ensure_future(asyncio.gather(*streams))
    while not work.done():
        await asyncio.wait([work], timeout=0.1)
        if not work.done() and await request.is_disconnected():
            for rid in rids:
                server.cancel(rid)
    try:
        token_lists = await work
    except RequestFailedError as exc:
        server.counts["failed"] += 1
        for rid in rids:
            server.cancel(rid)
        raise RequestError(f"generation failed: {exc}", status=500) from exc
    choices = []
    for i, (rid, tail, tokens) in enumerate(zip(rids, tails, token_lists, strict=True)):
        text = (echo.text if echo else "") + tail.feed(tokens) + tail.finish()
        entries = server.engine.result(rid).logprobs if options.logprobs is not None else None
        entries = None if entries is None else [*(echo.entries if echo else []), *entries]
        logprobs = None if entries is None else _logprobs(server, entries, chat)
        choice: dict[str, Any] = {"index": i, "finish_reason": server.finish_reason(rid), "logprobs": logprobs}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choices.append(choice)
    kind, prefix = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": server.name,
            "choices": choices, "usage": _usage(server, rids)}  # fmt: skip


async def _respond(server: _Server, request: Any, chat: bool) -> Any:
    """One completions / chat completions request: read, queue, answer (a stream or the whole body)."""
    from fastapi.responses import StreamingResponse
    from starlette.concurrency import run_in_threadpool

    try:
        body = await request.json()
    except ValueError as exc:
        raise RequestError("the request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    rids, options = server.start(body, chat)
    tails = [TextTail(server.tokenizer, options.stops) for _ in rids]
    try:
        echo = await run_in_threadpool(server.echoed, body, rids, options)
    except Exception as exc:
        for rid in rids:
            server.cancel(rid)
        raise RequestError(f"the prompt's log-probabilities failed: {exc!r}", "echo", 500) from exc
    if body.get("stream"):
        return StreamingResponse(_events(server, rids, tails, chat, options, echo), media_type="text/event-stream")
    return await _complete(server, rids, tails, chat, request, options, echo)


def create_app(model: nn.Module, tokenizer: Any, name: str = "hf_accel", engine: Engine | None = None) -> Any:
    """A FastAPI app serving ``model`` (patched by :func:`hf_accel.patch_model`) through an :class:`Engine`.

    The engine's background loop starts with the app and stops (cancelling what runs) when it shuts down.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    server = _Server(engine or Engine(model, tokenizer=tokenizer), tokenizer, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        server.engine.stop(cancel=True, timeout=30)

    app = FastAPI(title="hf-accel serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def generate(request: Request, chat: bool) -> Any:
        return await _respond(server, request, chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": server.name, "object": "model", "created": server.created, "owned_by": "hf_accel"}
        return {"object": "list", "data": [entry]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics())

    return app


def serve(model: nn.Module, tokenizer: Any, host: str = "127.0.0.1", port: int = 8000, name: str = "hf_accel") -> None:
    """Run :func:`create_app` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(model, tokenizer, name), host=host, port=port, log_level="info")
