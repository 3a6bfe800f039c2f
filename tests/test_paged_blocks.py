"""Tier (a): the pure block-allocation core (no tensors, no Transformers)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accel.paged.blocks import BlockCopy, BlockManager, BlockPool


def test_pool_hands_out_blocks_in_order_and_refuses_when_full():
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None  # only one left: a state, nothing changed
    assert pool.num_free == 1
    assert pool.allocate(1) == [2]
    assert pool.decref(1) is True
    assert pool.allocate(1) == [1]


def test_pool_misuse_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="double free"):
        pool.decref(0)
    with pytest.raises(ValueError, match="block 1 is free; it cannot be shared"):
        pool.incref(1)
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0)


def test_append_slots_maps_tokens_to_block_slots():
    m = BlockManager(num_blocks=4, block_size=4)
    s = m.new_sequence()
    slots, copies = m.append_slots(s, 6)
    assert slots == [0, 1, 2, 3, 4, 5] and copies == []
    assert m.block_table(s) == [0, 1] and m.num_tokens(s) == 6
    slots, _ = m.append_slots(s, 3)  # fills block 1, spills into block 2
    assert slots == [6, 7, 8] and m.block_table(s) == [0, 1, 2]


def test_append_returns_none_and_changes_nothing_when_full():
    m = BlockManager(num_blocks=2, block_size=4)
    s = m.new_sequence()
    m.append_slots(s, 5)
    assert m.blocks_needed(s, 4) == 1
    assert m.append_slots(s, 4) is None
    assert m.num_tokens(s) == 5 and m.block_table(s) == [0, 1] and m.num_free == 0


def test_fork_shares_and_copy_on_write_on_partial_block():
    m = BlockManager(num_blocks=6, block_size=4)
    a = m.new_sequence()
    m.append_slots(a, 6)  # blocks [0, 1], block 1 holds 2 tokens
    b = m.fork(a)
    assert m.block_table(b) == [0, 1] and m.num_shared() == 2
    slots, copies = m.append_slots(b, 1)
    assert copies == [BlockCopy(src=1, dst=2, num_tokens=2)]
    assert m.block_table(b) == [0, 2] and slots == [2 * 4 + 2]
    slots, copies = m.append_slots(a, 1)  # a is now the only owner of block 1: writes in place
    assert copies == [] and slots == [1 * 4 + 2]
    m.free(a)
    m.free(b)
    assert m.num_free == 6
    m.check_invariants()


def test_truncate_frees_blocks_and_published_block_is_never_overwritten():
    m = BlockManager(num_blocks=4, block_size=4)
    s = m.new_sequence()
    m.append_slots(s, 8)
    assert m.publish(s, list(range(8))) == 2
    m.truncate(s, 6)  # back inside published block 1
    assert m.block_table(s) == [0, 1]
    _, copies = m.append_slots(s, 1)
    assert copies == [BlockCopy(src=1, dst=2, num_tokens=2)]  # the cached block stays intact
    with pytest.raises(ValueError, match="cannot truncate sequence 0 of 7 tokens to 9"):
        m.truncate(s, 9)


def test_prefix_match_adopt_and_eviction():
    m = BlockManager(num_blocks=4, block_size=2)
    s = m.new_sequence()
    m.append_slots(s, 5)
    m.publish(s, [1, 2, 3, 4, 5])
    m.free(s)
    assert m.num_free == 2 and m.num_cached == 2  # the table keeps blocks 0 and 1
    assert m.match_prefix([1, 2, 3, 4, 9, 9]) == [0, 1]
    assert m.match_prefix([1, 2, 7, 7]) == [0]
    assert m.match_prefix([2, 1]) == []
    t = m.adopt([0, 1], 3)  # first 3 tokens: block 1 only partly ours
    assert m.block_table(t) == [0, 1] and m.num_tokens(t) == 3
    _, copies = m.append_slots(t, 1)
    assert copies == [BlockCopy(src=1, dst=2, num_tokens=1)]
    m.free(t)
    # 4 blocks needed: the free ones plus both cached blocks, evicted least recently used first
    u = m.new_sequence()
    assert m.append_slots(u, 8) is not None
    assert m.num_cached == 0
    m.check_invariants()


def test_same_block_tokens_under_different_prefixes_are_different_keys():
    m = BlockManager(num_blocks=8, block_size=2)
    a, b = m.new_sequence(), m.new_sequence()
    m.append_slots(a, 4)
    m.append_slots(b, 4)
    m.publish(a, [1, 2, 3, 4])
    m.publish(b, [9, 9, 3, 4])
    assert m.match_prefix([9, 9, 3, 4]) == m.block_table(b)
    assert m.match_prefix([1, 2, 3, 4]) == m.block_table(a)


_OPS = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free", "truncate", "publish", "adopt"]), st.integers(0, 50)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, block_size=st.integers(1, 5), num_blocks=st.integers(1, 12))
def test_random_interleavings_never_leak_or_double_own(ops, block_size, num_blocks):
    m = BlockManager(num_blocks, block_size)
    tokens: dict[int, list[int]] = {}
    owner: dict[int, int] = {}  # slot -> sequence that wrote it last (exclusive writes)
    for op, arg in ops:
        live = m.sequences()
        pick = live[arg % len(live)] if live else None
        if op == "new" or pick is None:
            tokens[m.new_sequence()] = []
        elif op == "append":
            count = arg % 7
            got = m.append_slots(pick, count)
            if got is None:
                assert m.blocks_needed(pick, count) > m.num_free + m.num_evictable
                continue
            slots, copies = got
            for c in copies:  # a copy target is a fresh block nobody else holds
                assert m.pool.refcount(c.dst) == 1
            for slot in slots:  # a slot being written belongs to this sequence alone
                block = slot // block_size
                assert m.pool.refcount(block) == 1
                owner[slot] = pick
            tokens[pick].extend(range(arg, arg + count))
        elif op == "fork":
            tokens[m.fork(pick)] = list(tokens[pick])
        elif op == "free":
            m.free(pick)
            del tokens[pick]
        elif op == "truncate":
            keep = arg % (len(tokens[pick]) + 1)
            m.truncate(pick, keep)
            del tokens[pick][keep:]
        elif op == "publish":
            m.publish(pick, tokens[pick])
        elif op == "adopt":
            blocks = m.match_prefix(tokens[pick])
            n = min(len(blocks) * block_size, arg % (len(blocks) * block_size + 1))
            tokens[m.adopt(blocks, n)] = tokens[pick][:n]
        m.check_invariants()
        for seq, toks in tokens.items():
            assert m.num_tokens(seq) == len(toks)
    for seq in m.sequences():
        m.free(seq)
    m.clear_prefix_cache()
    m.check_invariants()
    assert m.num_free == num_blocks


def test_null_prefix_table_publishes_and_matches_nothing():
    m = BlockManager(num_blocks=4, block_size=2, prefix_cache=False)
    s = m.new_sequence()
    m.append_slots(s, 4)
    assert m.publish(s, [1, 2, 3, 4]) == 0 and m.match_prefix([1, 2, 3, 4]) == []
    assert m.num_cached == 0 and m.num_evictable == 0 and not m.prefix_cache
    m.free(s)
    assert m.num_free == 4  # nothing was held back for a table
    m.check_invariants()


def test_evictable_counter_follows_every_reference_change():
    m = BlockManager(num_blocks=6, block_size=2)
    a = m.new_sequence()
    m.append_slots(a, 4)
    m.publish(a, [1, 2, 3, 4])
    assert m.num_evictable == 0  # the sequence still holds both blocks
    b = m.adopt(m.match_prefix([1, 2, 3, 4, 5]), 4)
    m.free(a)
    assert m.num_evictable == 0  # b holds them now
    m.truncate(b, 2)  # b lets go of the second block: only the table holds it
    assert m.num_evictable == 1
    m.free(b)
    assert m.num_evictable == 2
    m.check_invariants()
    c = m.new_sequence()
    assert m.append_slots(c, 10) is not None  # 5 blocks: 4 free + 1 evicted (least recently used)
    assert m.num_evictable == 1 and m.num_cached == 1
    m.check_invariants()
    m.clear_prefix_cache()
    assert m.num_evictable == 0 and m.num_cached == 0
    m.check_invariants()


def test_block_table_tensors_are_rebuilt_only_for_rows_that_changed():
    import torch

    from hf_accel.paged.plan import BlockTables

    m = BlockManager(num_blocks=8, block_size=2)
    a, b = m.new_sequence(), m.new_sequence()
    m.append_slots(a, 3)
    m.append_slots(b, 1)
    tables = BlockTables(m)
    first_a, first_b = tables.row(a), tables.row(b)
    assert torch.equal(tables.of([a, None, b]), torch.tensor([[0, 1], [0, 0], [2, 0]], dtype=torch.int32))
    m.append_slots(a, 1)  # fills a's second block: its table is unchanged
    m.append_slots(b, 2)  # b needs a new block
    assert tables.row(a) is first_a and tables.row(b) is not first_b
    assert tables.row(b).tolist() == [2, 3]
    m.free(a)
    tables.of([b])
    assert tables.row(b).tolist() == [2, 3]  # and a's cached row is forgotten with its sequence
