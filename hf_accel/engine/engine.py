"""``Engine``: continuous batching of many requests over one paged KV pool.

Each :meth:`Engine.step` runs one forward over a *packed* chunk: the tokens every scheduled request feeds this
step (decode tokens, prompt chunks, recomputation after preemption, speculative drafts) laid out back to back as
``[1, N]``, with per-token ``position_ids``. Linear layers and MLPs therefore see only real tokens; attention views
the chunk per request (:func:`hf_accel.paged.attention.attend_packed`). Requests join and leave the batch at every
step. The scheduling decisions are :class:`~.scheduler.Scheduler`'s (pure Python, tested on its own).

Threading: :meth:`add_request`, :meth:`cancel` and :meth:`stream` may be called from any thread; the model runs on
one thread, either the caller's (:meth:`step`, :meth:`run_until_done`, or a :meth:`stream` that drives the engine
itself) or the background thread of :meth:`start`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..core.call import device_of
from ..core.config import PagedConfig
from ..core.errors import IncompatibleOptionsError, NotPatchedError
from ..core.state import get_state
from ..paged.cache import PagedCache
from ..paged.layer import uses_paged_attention
from ..speculative.rows import length_following_rope
from .ledger import Ledger, UnknownRequestError
from .request import FinishReason, RequestFailedError, RequestOutput, Tracked, build_spec, prompt_ids
from .runner import choose, packed_forward, stop_reason
from .scheduler import Phase, Scheduler, SeqState, Work

__all__ = ["Engine", "EngineStoppedError", "UnknownRequestError"]

logger = logging.getLogger("hf_accel.engine")


class EngineStoppedError(IncompatibleOptionsError):
    """A request was added to (or the loop started on) an engine that was stopped."""


def _end_loop_at_exit(lock: threading.Condition, flag: list[bool], thread: threading.Thread) -> None:
    with lock:
        flag[0] = True
        lock.notify_all()
    thread.join(timeout=30)


class Engine:
    """Continuous batching for a model patched by :func:`hf_accel.patch_model` (with its ``paged`` feature).

    Args:
        model: the patched causal LM.
        tokenizer: needed for text prompts and stop strings.
        max_batch_tokens: tokens fed per step, all requests together (prompt chunks + decode tokens + drafts).
        max_running: requests decoding together.
        paged: the pool (:class:`~hf_accel.PagedConfig`); default: the patched model's paged config with the prefix
            cache on.
        keep_finished: outputs of finished requests kept for :meth:`result` / :meth:`stream`; beyond it the oldest
            are forgotten (a long-running engine does not grow without bound). Requests a :meth:`generate_many`
            call waits for are kept until it returns, however many there are.

    Raises:
        NotPatchedError: the model is not patched, or patched without the ``paged`` feature.
        IncompatibleOptionsError: bad sizes.

    Example::

        engine = hf_accel.Engine(model, tokenizer, max_running=8)
        a = engine.add_request("Tell me a joke", max_new_tokens=32)
        b = engine.add_request(ids, do_sample=True, temperature=0.7, max_new_tokens=64)
        outputs = engine.run_until_done()      # {request_id: RequestOutput}
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        max_batch_tokens: int = 1024,
        max_running: int = 16,
        paged: PagedConfig | None = None,
        keep_finished: int = 10_000,
    ) -> None:
        state = get_state(model)
        if state is None or state.config.paged is None or not uses_paged_attention(model):
            raise NotPatchedError(
                "Engine drives a model patched with the paged feature: call hf_accel.patch_model(model) first"
            )
        limits = {"max_batch_tokens": max_batch_tokens, "max_running": max_running, "keep_finished": keep_finished}
        for name, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise IncompatibleOptionsError(f"Engine.{name} must be an int >= 1, got {value!r}")
        if max_batch_tokens < max_running:
            raise IncompatibleOptionsError(
                f"Engine.max_batch_tokens ({max_batch_tokens}) must be >= max_running ({max_running}): every running "
                "request feeds at least one token per step"
            )
        if paged is not None and not isinstance(paged, PagedConfig):
            raise IncompatibleOptionsError(f"Engine.paged must be a PagedConfig or None, got {type(paged).__name__}")
        cfg = paged or dataclasses.replace(state.config.paged, prefix_cache=True)
        _warn_shared_rope(model)
        self.model = model
        self.tokenizer = tokenizer
        self.device = device_of(model)
        self.cache = PagedCache.from_config(model, cfg)
        # the scheduler admits against the pool's free blocks: it holds its whole budget from the start
        self.cache.reserve([self.cache.limit_blocks * self.cache.block_size], "an Engine (its whole budget)")
        self.scheduler = Scheduler(self.cache.manager, max_batch_tokens, max_running)
        self._lock = threading.Condition()
        self._stepping = threading.Lock()
        self._inbox: list[tuple[Tracked, SeqState]] = []
        self._cancels: list[int] = []
        self._ledger = Ledger(keep_finished)
        self._requests = self._ledger.requests  # by id (the ledger forgets old finished ones)
        self.keep_finished = keep_finished
        self._states: dict[int, SeqState] = {}
        self._next_id = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._exit = [False]  # set at interpreter exit (shared with the finalizer, which must not hold self)
        self.steps = 0
        self.forward_tokens = 0

    def __repr__(self) -> str:
        s = self.scheduler
        return (
            f"Engine(running={len(s.running)}, waiting={len(s.waiting)}, max_running={s.max_running}, "
            f"max_batch_tokens={s.max_batch_tokens}, pool={self.cache.num_blocks}x{self.cache.block_size} tokens)"
        )

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Any, generation_config: Any = None, **kwargs: Any) -> int:
        """Queue a request; it joins the running batch at a coming step.

        Args:
            prompt: token ids (a list of ints, or a 1D / ``[1, L]`` tensor) or a string (needs ``tokenizer``).
            generation_config: a ``GenerationConfig`` (default: the model's).
            **kwargs: what ``generate`` takes for one sequence: ``max_new_tokens``, ``do_sample``,
                ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``, ``stop_strings``,
                ``logits_processor``, ``stopping_criteria``, ``streamer``; ``prompt_lookup=True`` (or
                ``speculative=PromptLookup(...)``) to speculate with prompt lookup; ``seed=`` (an int): a generator
                of the request's own; ``logprobs=k``: each token's log-probability and ``k`` alternatives.

        Returns:
            The request id.

        Raises:
            EngineStoppedError: after :meth:`stop`.
            IncompatibleOptionsError: an empty prompt, a prompt + ``max_new_tokens`` the pool can never hold,
                options the engine does not support.
        """
        return self._enqueue(*self._prepare(prompt, generation_config, kwargs))

    def _prepare(self, prompt: Any, generation_config: Any, kwargs: dict[str, Any]) -> tuple[list[int], Any]:
        """A request's prompt ids and options, checked (nothing is queued yet)."""
        if self._closed:
            raise EngineStoppedError("this Engine was stopped; create a new one to add requests")
        ids = prompt_ids(prompt, self.tokenizer, self.model.config.get_text_config().vocab_size)
        if generation_config is not None:
            kwargs["generation_config"] = generation_config
        spec = build_spec(self.model, len(ids), kwargs, self.tokenizer, self.device)
        if len(ids) + spec.max_new_tokens > self.scheduler.capacity:
            raise IncompatibleOptionsError(
                f"prompt of {len(ids)} tokens + max_new_tokens={spec.max_new_tokens} needs "
                f"{len(ids) + spec.max_new_tokens} KV slots but the engine's pool holds "
                f"{self.scheduler.capacity}; give it a larger pool (paged=PagedConfig(num_blocks=...)) or lower "
                "max_new_tokens"
            )
        return ids, spec

    def _enqueue(self, ids: list[int], spec: Any, awaited: bool = False) -> int:
        """Queue a prepared request; ``awaited``: kept until :meth:`generate_many` collects it."""
        with self._lock:
            if self._closed:
                raise EngineStoppedError("this Engine was stopped; create a new one to add requests")
            rid = self._next_id
            self._next_id += 1
            state = SeqState(rid, list(ids), len(ids), spec.max_new_tokens, arrival=rid)
            tracked = Tracked(RequestOutput(rid, list(ids)), spec)
            if spec.streamer is not None:
                spec.streamer.put(torch.tensor([ids]))
            self._ledger.add(rid, tracked, awaited)
            self._inbox.append((tracked, state))
            self._lock.notify_all()
        return rid

    def cancel(self, request_id: int) -> None:
        """Cancel a request (from any thread); it ends with ``finish_reason="cancelled"`` at the next step.

        Raises:
            UnknownRequestError: an id this engine never returned.
        """
        with self._lock:
            self._tracked(request_id)
            self._cancels.append(request_id)
            self._lock.notify_all()

    def _tracked(self, request_id: int) -> Tracked:
        return self._ledger.get(request_id)

    def result(self, request_id: int) -> RequestOutput:
        """The request's output so far (complete once ``finish_reason`` is set)."""
        with self._lock:
            return self._tracked(request_id).output

    def stream(self, request_id: int, timeout: float | None = None) -> Iterator[int]:
        """Iterate over the request's tokens as they are generated, from its first one.

        Every call replays the request from its first token, so several consumers (or a second ``stream()`` after
        the first ended) each see all of them; on a finished request it yields what :meth:`result` holds and ends.
        Without a background loop (:meth:`start`), iterating drives the engine (all requests progress; concurrent
        consumers take turns stepping it).

        Raises:
            UnknownRequestError: an unknown id.
            RequestFailedError: the request failed (e.g. its logits processor raised).
            TimeoutError: no new token within ``timeout`` seconds (background loop only).
        """
        out = self._tracked(request_id).output
        sent = 0
        while True:
            with self._lock:
                if self._thread is not None:
                    fresh = lambda n=sent: out.finished or len(out.tokens) > n  # noqa: E731
                    if not self._lock.wait_for(fresh, timeout):
                        raise TimeoutError(f"request {request_id}: no token within {timeout} s")
                finished = out.finished  # read first: once finished, every token is in out.tokens
                tokens = out.tokens[sent:]
            if not tokens and not finished:  # caller-driven: take a step (or wait for another consumer's)
                if not self.step() and not out.finished and len(out.tokens) == sent:
                    raise RuntimeError(f"request {request_id} can make no progress (engine idle)")
                continue
            yield from tokens
            sent += len(tokens)
            if finished:
                if out.error is not None:
                    raise RequestFailedError(f"request {request_id} failed: {out.error!r}") from out.error
                return

    # --------------------------------------------------------------------------------------- loop
    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._inbox) or self.scheduler.has_work()

    def run_until_done(self) -> dict[int, RequestOutput]:
        """Step until every request is finished; returns the outputs not returned before, by request id."""
        if self._thread is not None:
            with self._lock:
                self._lock.wait_for(lambda: not self._inbox and not self.scheduler.has_work())
        else:
            while self.step():
                pass
        with self._lock:
            done = {rid: t.output for rid, t in self._requests.items() if t.output.finished and not t.collected}
            for rid in done:
                self._requests[rid].collected = True
        return done

    def start(self) -> Engine:
        """Run the engine loop on a background thread until :meth:`stop`."""
        if self._closed:
            raise EngineStoppedError("this Engine was stopped; create a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hf_accel-engine", daemon=True)
            self._thread.start()
            # a script that ends without stop(): end the loop between steps before the interpreter tears down
            # (a daemon thread killed inside a torch kernel aborts the process)
            weakref.finalize(self, _end_loop_at_exit, self._lock, self._exit, self._thread)
        return self

    def stop(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests; finish (or, with ``cancel``, cancel) the rest; end the background loop.

        Afterwards every block of the requests is back in the pool (cached prefixes stay reusable).
        """
        with self._lock:
            self._closed = True
            if cancel:
                self._cancels.extend(rid for rid, t in self._requests.items() if not t.output.finished)
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the engine loop did not finish within {timeout} s")
            self._thread = None
        else:
            while self.step():
                pass

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(
                    lambda: self._inbox or self._cancels or self.scheduler.has_work() or self._closed or self._exit[0]
                )
                if self._exit[0]:
                    return
                if self._closed and not self._inbox and not self._cancels and not self.scheduler.has_work():
                    return
            try:
                self.step()
            except Exception as exc:  # a bug must not leave waiters hanging: fail what is left, end the loop
                logger.exception("engine loop failed")
                self._fail_all(exc)
                return
            finally:
                with self._lock:
                    self._lock.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._closed = True
        self._drain()
        for state in [*self.scheduler.running, *self.scheduler.waiting]:
            self._end(state, FinishReason.FAILED, exc, publish=False)

    def step(self) -> bool:
        """Run one engine step (admit, forward, sample, stream). Returns ``False`` when there was nothing to do."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise IncompatibleOptionsError("the engine loop runs in the background (start()); do not call step()")
        with self._stepping:  # callers driving it from several threads take turns
            return self._step()

    def _step(self) -> bool:
        self._drain()
        works = self.scheduler.schedule(self._propose)
        if not works:
            return False
        self.steps += 1
        try:
            self.forward_tokens += sum(len(w.tokens) + len(w.drafts) for w in works)
            logits = packed_forward(self.model, self.cache, works, self.device)
        except Exception as exc:  # a failing forward fails the requests in it, not the engine
            logger.exception("engine forward failed; failing %d requests", len(works))
            for w in works:
                self._end(w.state, FinishReason.FAILED, exc, publish=False)
            return True
        for w in works:
            state = w.state
            try:
                if w.sample:
                    self._advance(w, logits.pop(state.rid))
                else:
                    self.scheduler.publish_prompt(state)
            except Exception as exc:  # e.g. a user logits processor raising: this request fails alone
                logger.warning("request %d failed: %r", state.rid, exc)
                self._end(state, FinishReason.FAILED, exc, publish=False)
        return True

    def _drain(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            if inbox:  # new requests may adopt cached prefixes: not ones computed with other weights
                self.cache.check_weights()
            for _, state in inbox:
                self._states[state.rid] = state
                self.scheduler.add(state)
        for rid in cancels:
            state = self._states.get(rid)
            if state is not None and state.phase is not Phase.DONE:
                self._end(state, FinishReason.CANCELLED)

    def generate_many(self, prompts: Sequence[Any], **kwargs: Any) -> list[torch.Tensor]:
        """Add every prompt with the same ``generate`` kwargs, run them all, return their sequences in order.

        Returns:
            One 1D tensor per prompt: its tokens then the generated ones (``generate``'s row, without padding).

        Raises:
            RequestFailedError: a request failed (the first one, in prompt order).
        """
        prepared = [self._prepare(p, None, dict(kwargs)) for p in prompts]  # every prompt checked before any runs
        ids = [self._enqueue(*request, awaited=True) for request in prepared]
        outputs = self.run_until_done() if self._thread is None else {}
        try:
            found = [outputs[rid] if rid in outputs else self._wait(rid) for rid in ids]
        finally:
            with self._lock:
                for rid in ids:
                    self._ledger.collected(rid)
        for out in found:
            out.raise_for_error()
        return [out.sequence for out in found]

    def _wait(self, rid: int) -> RequestOutput:
        tracked = self._tracked(rid)
        with self._lock:
            self._lock.wait_for(lambda: tracked.output.finished)
            tracked.collected = True
        return tracked.output

    def _end(
        self, state: SeqState, reason: FinishReason, error: BaseException | None = None, publish: bool = True
    ) -> None:
        if not publish:
            state.computed = 0  # K/V of a failed step may be incomplete: publish nothing of it
        self.scheduler.finish(state)
        tracked = self._requests[state.rid]
        tracked.output.preemptions = state.preemptions
        with self._lock:
            tracked.close(reason, error)
            self._states.pop(state.rid, None)
            self._ledger.finished(state.rid)
            self._lock.notify_all()

    # ----------------------------------------------------------------------------------- forward
    def _propose(self, state: SeqState, budget: int) -> list[int]:
        spec = self._requests[state.rid].spec
        if spec.lookup is None:
            return []
        (proposal,) = spec.lookup.propose([torch.tensor(state.tokens)], [min(budget, spec.lookup.k.num_tokens)])
        return proposal.tokens.tolist()

    def _advance(self, work: Work, logits: tuple[torch.Tensor, list[int]]) -> None:
        """Pick the request's next token(s) from ``logits`` ([1 + drafts, V], with their argmax), verify drafts,
        stream, stop."""
        state = work.state
        tracked = self._requests[state.rid]
        self.scheduler.publish_prompt(state)
        verdict, entries = choose(tracked, work.drafts, *logits)
        tracked.output.proposed += len(work.drafts)
        tracked.output.accepted += verdict.accepted
        self.scheduler.accept(work, verdict.accepted)
        for token, entry in zip(verdict.tokens, entries, strict=True):
            state.tokens.append(token)
            tracked.emit(token, entry)
            reason = stop_reason(tracked, token, state.generated, state.max_new_tokens)
            if reason is not None:
                state.computed = min(state.computed, len(state.tokens) - 1)
                self._end(state, reason)
                return


def _warn_shared_rope(model: nn.Module) -> None:
    """Say once per engine that requests stepped together share a length-following rotary embedding's frequencies."""
    for kind, limit in length_following_rope(model.config):
        logger.warning(
            "hf_accel: Engine: %s's rotary embedding (rope_type %r) takes its frequencies from the longest sequence "
            "in each forward past %d tokens, so a request stepped with longer ones may get other tokens than its own "
            "generate call (as in Transformers' batched generate); call generate per request where that matters",
            type(model).__name__,
            kind,
            limit,
        )
