"""Continuous-batching scheduler: pure Python over a :class:`~hf_accel.paged.blocks.BlockManager`.

No tensors, no Transformers. Each step it decides which sequences feed which tokens, reserving their KV slots:

1. running sequences that are decoding get one token each (their last one), oldest first;
2. running sequences still prefilling get their next prompt chunk from what is left of the token budget;
3. waiting sequences are admitted in arrival order (FIFO) while the budget, ``max_running`` and the pool allow,
   reusing cached prompt prefixes; a long prompt is prefilled in chunks across steps; a sequence whose prompt
   mostly repeats a running prompt not yet published waits for it (and adopts its blocks), later ones go ahead;
4. decoding sequences with a proposer get draft tokens from the budget left over (never at another's expense).

A sequence's state is its tokens (prompt + generated) and ``computed``, how many of them have K/V in the pool;
each step feeds ``tokens[computed:]`` (a chunk of it while prefilling). Prefill, decode and the recomputation of
a preempted sequence are therefore the same operation.

When the pool cannot serve a running sequence, the youngest running sequence is preempted: its blocks are
published to the prefix table (so recomputation may find them again) and freed, and it goes back to the waiting
queue at its arrival position. The oldest sequence always progresses (nothing older can preempt it), so there is
no starvation; a sequence is only accepted when its prompt plus ``max_new_tokens`` fits the whole pool, so a
sequence alone in the pool always fits and there is no deadlock.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from ..paged.blocks import BlockCopy, BlockManager

__all__ = ["Phase", "Scheduler", "SeqState", "Work"]


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass
class SeqState:
    """One request's sequence.

    Args:
        rid: request id.
        tokens: prompt then generated tokens.
        prompt_len: tokens of the prompt.
        max_new_tokens: tokens the request may generate.
        arrival: admission order (lower = older).
    """

    rid: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    arrival: int
    seq: int | None = None
    computed: int = 0
    phase: Phase = Phase.WAITING
    preemptions: int = 0
    prompt_published: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def max_tokens(self) -> int:
        """KV slots the sequence needs at most: its prompt and every token it may generate."""
        return self.prompt_len + self.max_new_tokens

    @property
    def decoding(self) -> bool:
        """Only the last token lacks K/V: the next step samples a token."""
        return self.computed == len(self.tokens) - 1


@dataclass
class Work:
    """What one sequence feeds in one step.

    Args:
        state: the sequence.
        start: ``state.computed`` before the step (position of the first fed token).
        tokens: fed tokens: ``tokens[start:start + n]`` of the sequence, then ``drafts``.
        drafts: proposed tokens appended after the sequence's last token (decoding only).
        slots / copies: pool slots reserved for the fed tokens, copy-on-write copies to perform first.
        sample: the chunk ends at the sequence's last token, so its logits pick the next token(s).
    """

    state: SeqState
    start: int
    tokens: list[int]
    drafts: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)
    sample: bool = False


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


#: ``propose(state, max_tokens) -> drafts`` (at most ``max_tokens``; ``[]`` for none).
Proposer = Callable[[SeqState, int], list[int]]


class Scheduler:
    """FIFO continuous batching with a per-step token budget and preemption by recomputation.

    Args:
        manager: the block manager of the pool the model's cache uses.
        max_batch_tokens: tokens fed per step, all sequences together (``>= max_running``).
        max_running: sequences in the running batch.

    Prompt blocks are reused and finished / preempted sequences' blocks published through the manager's prefix
    table (a :class:`~hf_accel.paged.prefix.NullPrefixTable` when prefix caching is off: nothing is).
    """

    def __init__(self, manager: BlockManager, max_batch_tokens: int, max_running: int) -> None:
        if max_running < 1 or max_batch_tokens < max_running:
            raise ValueError(
                f"need 1 <= max_running <= max_batch_tokens, got max_running={max_running}, "
                f"max_batch_tokens={max_batch_tokens}"
            )
        self.manager = manager
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: list[SeqState] = []  # sorted by arrival
        self.running: list[SeqState] = []  # sorted by arrival
        self.preemptions = 0
        self.prefix_hit_tokens = 0  # prompt (or recomputed) tokens adopted from the prefix table at admission

    # ---------------------------------------------------------------------------------------- queries
    @property
    def capacity(self) -> int:
        """Tokens the whole pool holds."""
        return self.manager.num_blocks * self.manager.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------------------------------- lifecycle
    def add(self, state: SeqState) -> None:
        """Queue a new sequence.

        Raises:
            ValueError: an empty prompt, or prompt + ``max_new_tokens`` beyond what the pool can ever hold.
        """
        if state.prompt_len < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if state.max_tokens > self.capacity:
            raise ValueError(
                f"prompt of {state.prompt_len} tokens + max_new_tokens={state.max_new_tokens} needs "
                f"{state.max_tokens} KV slots but the whole pool holds {self.capacity}; "
                "give the engine a larger pool or lower max_new_tokens"
            )
        state.phase = Phase.WAITING
        bisect.insort(self.waiting, state, key=lambda s: s.arrival)

    def finish(self, state: SeqState) -> None:
        """The sequence is done (finished, cancelled or failed): publish its blocks and free them."""
        if state in self.running:
            self.running.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        self._release(state)
        state.phase = Phase.DONE

    def _release(self, state: SeqState) -> None:
        if state.seq is None:
            return
        self.manager.publish(state.seq, state.tokens[: state.computed])
        self.manager.free(state.seq)
        state.seq = None
        state.computed = 0

    def _preempt(self, state: SeqState) -> None:
        self.running.remove(state)
        self._release(state)
        state.preemptions += 1
        self.preemptions += 1
        self.add(state)

    # ------------------------------------------------------------------------------------- scheduling
    def schedule(self, propose: Proposer | None = None) -> list[Work]:
        """Plan one step: reserve slots and return what each scheduled sequence feeds (oldest first)."""
        budget = self.max_batch_tokens
        plan: dict[int, Work] = {}
        decoding = [s for s in self.running if s.decoding]
        prefilling = [s for s in self.running if not s.decoding]
        for state in decoding:
            if state in self.running and self._reserve(state, 1, plan):
                budget -= 1
        for state in prefilling:
            if budget <= 0:
                break
            if state in self.running:
                n = min(budget, len(state.tokens) - state.computed)
                if self._reserve(state, n, plan):
                    budget -= n
        budget = self._admit(budget, plan)
        if propose is not None:
            self._add_drafts(budget, plan, propose)
        return sorted(plan.values(), key=lambda w: w.state.arrival)

    def _reserve(self, state: SeqState, n: int, plan: dict[int, Work]) -> bool:
        """Reserve ``n`` slots for a running sequence, preempting younger ones (or itself) when the pool is full."""
        while True:
            got = self.manager.append_slots(state.seq, n)  # type: ignore[arg-type]
            if got is not None:
                self._add_work(state, n, got, plan)
                return True
            victim = self.running[-1]
            undone = plan.pop(victim.rid, None)  # a younger decoder planned earlier in this step gives way
            if undone is not None:
                victim.computed = undone.start
            self._preempt(victim)
            if victim is state:
                return False

    def _add_work(self, state: SeqState, n: int, got: tuple[list[int], list[BlockCopy]], plan: dict[int, Work]) -> None:
        start = state.computed
        state.computed += n
        plan[state.rid] = Work(
            state,
            start,
            state.tokens[start : start + n],
            slots=got[0],
            copies=got[1],
            sample=state.computed == len(state.tokens),
        )

    def _admit(self, budget: int, plan: dict[int, Work]) -> int:
        """Admit waiting sequences in arrival order; one whose prompt mostly repeats a prompt still being computed
        waits for it (it then adopts those blocks instead of computing them again) while later ones go ahead."""
        deferred = 0
        while len(self.waiting) > deferred and budget > 0 and len(self.running) < self.max_running:
            state = self.waiting[deferred]
            if self._shares_prompt_in_flight(state):
                deferred += 1
                continue
            self._attach(state)
            n = min(budget, len(state.tokens) - state.computed)
            got = self.manager.append_slots(state.seq, n)  # type: ignore[arg-type]
            if got is None:  # the pool is full of running sequences: wait for one to finish
                self._release(state)
                break
            self.waiting.pop(deferred)
            self.prefix_hit_tokens += state.computed
            state.phase = Phase.RUNNING
            bisect.insort(self.running, state, key=lambda s: s.arrival)
            self._add_work(state, n, got, plan)
            budget -= n
        return budget

    def _shares_prompt_in_flight(self, state: SeqState) -> bool:
        """Whether at least half of ``state``'s prompt (and a whole block) repeats the prompt of a running sequence
        whose prompt is not computed and published yet: the several choices of one request, or a burst of requests
        with one long system prompt (SGLang calls this in-batch prefix caching)."""
        if not self.manager.prefix_cache or state.computed or state.preemptions:
            return False
        size, want = self.manager.block_size, state.tokens[: state.prompt_len - 1]
        for other in self.running:
            if other.prompt_published:
                continue
            shared = _common_prefix(want, other.tokens[: other.prompt_len])
            if shared >= size and 2 * shared >= len(want):
                return True
        return False

    def _attach(self, state: SeqState) -> None:
        """Give a waiting sequence its block table, adopting the longest cached prefix of its tokens."""
        blocks = self.manager.match_prefix(state.tokens[:-1])
        n = len(blocks) * self.manager.block_size
        state.seq = self.manager.adopt(blocks, n) if n else self.manager.new_sequence()
        state.computed = n

    def _add_drafts(self, budget: int, plan: dict[int, Work], propose: Proposer) -> None:
        for work in sorted(plan.values(), key=lambda w: w.state.arrival):
            state = work.state
            room = state.max_new_tokens - state.generated - 1  # the verified step adds one token of its own
            if budget <= 0 or not work.sample or len(work.tokens) != 1 or room <= 0:
                continue
            drafts = list(propose(state, min(budget, room)))[: min(budget, room)]
            if not drafts:
                continue
            got = self.manager.append_slots(state.seq, len(drafts))  # type: ignore[arg-type]
            if got is None:  # drafts are optional: no preemption for them
                continue
            work.drafts = drafts
            work.slots += got[0]
            work.copies += got[1]
            state.computed += len(drafts)
            budget -= len(drafts)

    # ------------------------------------------------------------------------------------ after a step
    def accept(self, work: Work, accepted: int) -> None:
        """Record a sampled step: ``accepted`` of the step's drafts were kept; the K/V of the rejected ones is dropped
        from the pool. The caller appends the step's tokens to ``work.state.tokens``.
        """
        state = work.state
        rejected = len(work.drafts) - accepted
        if rejected:
            state.computed -= rejected
            self.manager.truncate(state.seq, state.computed)  # type: ignore[arg-type]

    def publish_prompt(self, state: SeqState) -> None:
        """Publish the prompt's full blocks once they are computed (later requests with that prefix reuse them)."""
        if not state.prompt_published and state.computed >= state.prompt_len:
            self.manager.publish(state.seq, state.tokens[: state.prompt_len])  # type: ignore[arg-type]
            state.prompt_published = True
