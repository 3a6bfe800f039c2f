"""Tier (a): the continuous-batching scheduler on its own (pure Python, exact state)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.engine.scheduler import Phase, Scheduler, SeqState
from hf_accel.paged.blocks import BlockManager


def make(num_blocks=8, block_size=4, max_batch_tokens=16, max_running=4, prefix_cache=False):
    return Scheduler(BlockManager(num_blocks, block_size, prefix_cache), max_batch_tokens, max_running)


def seq(rid, prompt_len, max_new=4, first=10):
    return SeqState(rid, list(range(first, first + prompt_len)), prompt_len, max_new, arrival=rid)


def fake_sample(sched, works, token=99):
    """What the engine does after a forward: sampling works gain one token."""
    for w in works:
        if w.sample:
            sched.accept(w, 0)
            w.state.tokens.append(token)


def test_fifo_admission_budget_and_chunked_prefill():
    s = make(max_batch_tokens=10)
    a, b = seq(0, 7), seq(1, 6)
    s.add(a)
    s.add(b)
    works = s.schedule()
    # a takes 7 tokens (its whole prompt), b the 3 left in the budget (a chunk, no sampling yet)
    assert [(w.state.rid, w.start, len(w.tokens), w.sample) for w in works] == [(0, 0, 7, True), (1, 0, 3, False)]
    assert a.phase is Phase.RUNNING and b.phase is Phase.RUNNING
    assert works[0].slots == [0, 1, 2, 3, 4, 5, 6]  # blocks 0 and 1 of 4 slots
    fake_sample(s, works)
    works = s.schedule()
    # a decodes 1 token first; b continues its prefill with the rest of its prompt
    assert [(w.state.rid, w.start, w.tokens, w.sample) for w in works] == [
        (0, 7, [99], True),
        (1, 3, [13, 14, 15], True),
    ]


def test_max_running_and_waiting_order():
    s = make(max_running=2, max_batch_tokens=16)
    for rid in range(3):
        s.add(seq(rid, 2))
    works = s.schedule()
    assert [w.state.rid for w in works] == [0, 1]
    assert [x.rid for x in s.waiting] == [2]
    s.finish(works[0].state)
    fake_sample(s, works[1:])
    assert [w.state.rid for w in s.schedule()] == [1, 2]


def test_preempts_youngest_and_requeues_it_by_arrival():
    s = make(num_blocks=4, block_size=2, max_batch_tokens=16, max_running=4)
    old, young = seq(0, 3, max_new=4), seq(1, 3, max_new=4)
    s.add(old)
    s.add(young)
    works = s.schedule()  # 2 + 2 blocks: the pool is full
    assert s.manager.num_free == 0
    fake_sample(s, works)  # both now hold 4 tokens, 3 computed: the next token fits their second block
    fake_sample(s, s.schedule())  # both hold 5 tokens, 4 computed: the next needs a 3rd block each
    works = s.schedule()
    assert [w.state.rid for w in works] == [0]
    assert young.phase is Phase.WAITING and young.seq is None and young.computed == 0
    assert young.preemptions == 1 and s.preemptions == 1
    assert s.waiting == [young]
    s.manager.check_invariants()


def test_capacity_and_empty_prompt_errors():
    s = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match=r"needs 9 KV slots but the whole pool holds 8"):
        s.add(seq(0, 5, max_new=4))
    with pytest.raises(ValueError, match="the prompt is empty"):
        s.add(SeqState(1, [], 0, 4, arrival=1))
    with pytest.raises(ValueError, match="max_running <= max_batch_tokens"):
        Scheduler(BlockManager(2, 4, prefix_cache=False), max_batch_tokens=2, max_running=3)


def test_prefix_reuse_skips_cached_blocks():
    s = make(num_blocks=8, block_size=4, prefix_cache=True)
    a = seq(0, 9)
    s.add(a)
    works = s.schedule()
    s.publish_prompt(a)  # 2 full blocks published
    fake_sample(s, works)
    s.finish(a)
    b = SeqState(1, [*range(10, 19), 50], 10, 4, arrival=1)  # same 9 tokens, then another
    s.add(b)
    (w,) = s.schedule()
    assert (w.start, w.tokens) == (8, [18, 50])  # 8 tokens adopted from the prefix table
    assert s.prefix_hit_tokens == 8
    s.manager.check_invariants()


def test_drafts_use_only_leftover_budget_and_rejections_are_rolled_back():
    s = make(num_blocks=16, block_size=4, max_batch_tokens=8, max_running=4)
    a = seq(0, 3, max_new=10)
    s.add(a)
    fake_sample(s, s.schedule())
    works = s.schedule(propose=lambda state, k: [7] * k)
    (w,) = works
    assert w.tokens == [99] and w.drafts == [7] * 7  # 8 - 1 decode token
    assert a.computed == 3 + 1 + 7
    s.accept(w, accepted=2)
    a.tokens.extend([7, 7, 42])
    assert a.computed == 3 + 1 + 2 and s.manager.num_tokens(a.seq) == 6
    assert a.tokens[-4:] == [99, 7, 7, 42] and a.decoding
    s.manager.check_invariants()


def test_drafts_respect_max_new_tokens():
    s = make(max_batch_tokens=16)
    a = seq(0, 2, max_new=3)
    s.add(a)
    fake_sample(s, s.schedule())  # 1 generated, 2 may follow: the verify step adds 1, so 1 draft at most
    (w,) = s.schedule(propose=lambda state, k: [5] * k)
    assert w.drafts == [5]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_random_workloads_always_finish_and_free_the_pool(seed):
    """Random arrivals, lengths, cancellations and a small pool: nothing starves, deadlocks or leaks."""
    rng = random.Random(seed)
    s = make(num_blocks=6, block_size=2, max_batch_tokens=rng.randint(3, 9), max_running=3, prefix_cache=True)
    states, next_rid, done = [], 0, set()
    for _ in range(400):
        if next_rid < 12 and rng.random() < 0.3:
            p, n = rng.randint(1, 6), rng.randint(1, 5)
            st_ = SeqState(next_rid, [rng.randint(3, 6) for _ in range(p)], p, n, arrival=next_rid)
            s.add(st_)
            states.append(st_)
            next_rid += 1
        if rng.random() < 0.03 and s.running:
            victim = rng.choice(s.running)
            s.finish(victim)
            done.add(victim.rid)
        works = s.schedule(propose=lambda state, k: [rng.randint(3, 6) for _ in range(rng.randint(0, k))])
        for w in works:
            if seed % 2:  # as the engine does after each step (half the runs: waiting twins then wait for finishes)
                s.publish_prompt(w.state)
            if w.sample:
                accepted = rng.randint(0, len(w.drafts))
                s.accept(w, accepted)
                w.state.tokens.extend([*w.drafts[:accepted], rng.randint(3, 6)])
                if w.state.generated >= w.state.max_new_tokens:
                    s.finish(w.state)
                    done.add(w.state.rid)
        s.manager.check_invariants()
        if next_rid == 12 and not s.has_work():
            break
    assert not s.has_work(), f"unfinished: running={[x.rid for x in s.running]} waiting={[x.rid for x in s.waiting]}"
    assert done == set(range(12))
    assert s.manager.sequences() == []
    assert s.manager.num_free + s.manager.num_evictable == s.manager.num_blocks


def test_a_prompt_that_repeats_one_in_flight_waits_to_adopt_its_blocks():
    """In-batch prefix sharing: a waiting sequence whose prompt mostly repeats a running prompt not yet published
    waits a step and adopts those blocks; a sequence that shares little, and later arrivals, go ahead."""
    s = make(num_blocks=16, block_size=4, max_batch_tokens=64, max_running=4, prefix_cache=True)
    a, twin = seq(0, 10), seq(1, 10)
    other = SeqState(2, [*range(10, 13), *range(40, 47)], 10, 4, arrival=2)  # shares 3 tokens: not a block
    for state in (a, twin, other):
        s.add(state)
    works = s.schedule()
    assert [(w.state.rid, w.start) for w in works] == [(0, 0), (2, 0)] and [x.rid for x in s.waiting] == [1]
    s.publish_prompt(a)
    fake_sample(s, works)
    works = s.schedule()
    assert [(w.state.rid, w.start, len(w.tokens)) for w in works] == [(0, 10, 1), (1, 8, 2), (2, 10, 1)]
    assert s.prefix_hit_tokens == 8  # two blocks adopted instead of computed
    s.manager.check_invariants()
    off = make(num_blocks=16, block_size=4, max_batch_tokens=64, prefix_cache=False)
    for state in (seq(0, 10), seq(1, 10)):
        off.add(state)
    assert len(off.schedule()) == 2  # nothing to adopt without a prefix cache: no waiting
