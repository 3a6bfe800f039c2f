"""The Transformers cache a speculative call leaves to someone who keeps it (the caller's ``cache=``, or the one
``return_dict_in_generate`` returns): what Transformers' own decoding leaves, so a continuation is exact."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PAD, random_batch, run_threads, tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import hf_accel
from hf_accel import IncompatibleOptionsError
from hf_accel.native.growing import to_growing
from hf_accel.speculative.ragged import RaggedCache

# ------------------------------------------------------------------------------------------ exact state


def _coded_cache(mask: torch.Tensor, layers: int = 2) -> DynamicCache:
    """A cache whose K/V entry at (row b, head h, column t) is ``1000 * b + t`` (V: its negative)."""
    batch, width = mask.shape
    cache = DynamicCache()
    code = (1000 * torch.arange(batch)[:, None] + torch.arange(width)[None]).float()  # [B, T]
    k = code[:, None, :, None].expand(batch, 2, width, 3).contiguous()  # [B, H_kv=2, T, D=3]
    for i in range(layers):
        cache.update(k.clone(), -k.clone(), i)
    return cache


def _columns(cache: DynamicCache) -> torch.Tensor:
    """The column each entry of every layer came from, ``[B, T]`` (checked equal across layers, heads, dims)."""
    first = cache.layers[0].keys
    for layer in cache.layers:
        assert torch.equal(layer.keys, first) and torch.equal(layer.values, -first)
    codes = first[:, 0, :, 0]  # [B, T]
    assert torch.equal(first, codes[:, None, :, None].expand_as(first))
    return codes - 1000 * torch.arange(codes.shape[0])[:, None]


def test_settle_lays_each_row_out_without_holes():
    """Holes (rejected drafts) go, every row keeps its padding, prompt and all but the last generated token."""
    prompt = torch.tensor([[0, 1, 1], [1, 1, 1]])  # [B, P]: row 0 has one pad
    #                        pad  p  p | t1 hole t2 t3 hole | t4 (fed past the end)
    layout = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 1], [1, 1, 1, 0, 1, 1, 1, 1, 1]])
    ragged = RaggedCache(torch.nn.Identity(), _coded_cache(layout), layout)
    # both rows generated 4 tokens: the cache holds the prompt plus 3 of them (the last is never fed)
    assert ragged.settle(prompt, [4, 4]) == "kept"
    assert ragged.cache.get_seq_length() == 6
    assert _columns(ragged.cache).tolist() == [[0, 1, 2, 3, 5, 6], [0, 1, 2, 4, 5, 6]]
    assert ragged.mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


def test_settle_crops_a_cache_without_holes_and_gathers_growing_layers():
    prompt = torch.ones(1, 3, dtype=torch.long)
    layout = torch.ones(1, 8, dtype=torch.long)  # accepted drafts past the stop are still in it
    ragged = RaggedCache(torch.nn.Identity(), _coded_cache(layout), layout)
    assert ragged.settle(prompt, [3]) == "kept"
    assert _columns(ragged.cache).tolist() == [[0, 1, 2, 3, 4]]
    growing = to_growing(_coded_cache(torch.ones(2, 5, dtype=torch.long)))
    holes = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    ragged = RaggedCache(torch.nn.Identity(), growing, holes)
    assert ragged.settle(torch.ones(2, 2, dtype=torch.long), [3, 3]) == "kept"
    assert _columns(ragged.cache).tolist() == [[0, 1, 3, 4], [0, 1, 2, 3]]
    growing.update(torch.zeros(2, 2, 1, 3), torch.zeros(2, 2, 1, 3), 0)  # it still appends after the gather
    assert growing.layers[0].keys.shape[-2] == 5


@pytest.mark.parametrize(
    "case, why",
    [
        ("lengths", "rows stopped at different lengths"),
        ("rows", "rows stopped at different lengths"),
        ("sliding", "a sliding window"),
        ("short", "lacks tokens"),
    ],
)
def test_settle_empties_what_it_cannot_lay_out(case, why):
    """Rows of different lengths (Transformers' cache would hold K/V of padding nobody computed), a batch that lost
    rows, a sliding-window layer with holes, a layout shorter than the sequences: emptied, never left wrong."""
    prompt = torch.ones(2, 2, dtype=torch.long)
    layout = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]])
    cache = _coded_cache(layout)
    generated = {"lengths": [3, 2], "short": [5, 5]}.get(case, [3, 3])
    if case == "rows":
        cache.batch_select_indices(torch.tensor([1]))
        layout = layout[1:]
    if case == "sliding":
        layer = DynamicSlidingWindowLayer(sliding_window=64)
        layer.update(cache.layers[0].keys, cache.layers[0].values)
        cache.layers[0] = layer
    ragged = RaggedCache(torch.nn.Identity(), cache, layout)
    outcome = ragged.settle(prompt, generated)
    assert outcome.startswith("emptied: ") and why in outcome
    assert cache.get_seq_length() == 0 and ragged.mask.shape[1] == 0


# ------------------------------------------------------------------------------------------ model level


def _plain_and_patched(**patch):
    plain = tiny_model("llama")
    return plain, hf_accel.patch_model(copy.deepcopy(plain), **patch)


def _continue(model, result, mask, **kwargs):
    """The next turn: the returned sequences and cache passed back, six more tokens."""
    grown = torch.ones(mask.shape[0], result.sequences.shape[1] - mask.shape[1], dtype=mask.dtype)
    return model.generate(
        input_ids=result.sequences,
        attention_mask=torch.cat([mask, grown], 1),
        cache=result.past_key_values,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=PAD,
        **kwargs,
    )


def _strategy(name: str) -> dict:
    if name == "auto":
        return {}  # the default patch on this CPU speculates greedy calls by itself
    if name == "draft":
        return {"draft_model": tiny_model("llama", seed=7)}
    return {"prompt_lookup": True}


@pytest.mark.parametrize("strategy", ["auto", "prompt_lookup", "draft"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_returned_cache_is_the_one_transformers_returns(strategy, batch):
    """``return_dict_in_generate``: the cache holds every row's K/V but the last token's, as plain decoding leaves
    it (the same values at every real position), and continuing from it gives the unpatched model's tokens."""
    plain, patched = _plain_and_patched()
    ids, mask = random_batch(batch, seed=4)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    got = patched.generate(
        input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs, **_strategy(strategy)
    )
    assert torch.equal(got.sequences, expected.sequences)
    spec = hf_accel.last_stats(patched).speculative
    assert spec is not None and spec["cache"] == "kept", spec
    cache, reference = got.past_key_values, expected.past_key_values
    assert cache.get_seq_length() == reference.get_seq_length() == expected.sequences.shape[1] - 1
    real = torch.cat([mask, torch.ones(batch, kwargs["max_new_tokens"] - 1, dtype=mask.dtype)], 1).bool()
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):  # [B, H_kv, T, D]
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(_continue(patched, got, mask), _continue(plain, expected, mask))


def test_returned_caches_continue_exactly_from_several_threads():
    """Threads of a web server, each running two turns (the automatic speculation, prompt lookup, the paged cache):
    every thread's turns equal the unpatched model's."""
    plain, patched = _plain_and_patched()
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD, return_dict_in_generate=True)
    jobs = [
        (*random_batch(1 + i % 3, seed=i), 8 + i, [{}, {"prompt_lookup": True}, {"paged": True}][i % 3])
        for i in range(6)
    ]

    def turns(model, ids, mask, new, extra):
        first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **kwargs, **extra)
        return first.sequences, _continue(model, first, mask)

    expected = [turns(plain, ids, mask, new, {}) for ids, mask, new, _ in jobs]
    got: list = [None] * len(jobs)

    def job(k: int) -> None:
        for _ in range(2):
            got[k] = turns(patched, *jobs[k])

    run_threads([lambda k=k: job(k) for k in range(len(jobs))])
    for k, ((seq, nxt), (want_seq, want_nxt)) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(seq, want_seq) and torch.equal(nxt, want_nxt), k


def test_rows_that_stop_apart_leave_an_empty_cache_that_continues_exactly():
    """A row stopping on EOS before the others: Transformers' cache would hold K/V of the padding fed after it, which
    no speculative step computed, so the returned cache is empty and a continuation recomputes the sequences."""
    plain, patched = _plain_and_patched()
    ids, mask = random_batch(3, seed=4)
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=int(probe[0, ids.shape[1] + 2]), pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
    got = patched.generate(
        input_ids=ids, attention_mask=mask, return_dict_in_generate=True, prompt_lookup=True, **kwargs
    )
    assert torch.equal(got.sequences, expected.sequences)
    assert got.speculative["cache"] == "emptied: rows stopped at different lengths"
    assert got.past_key_values.get_seq_length() == 0
    assert torch.equal(_continue(patched, got, mask), _continue(plain, expected, mask))


def test_a_callers_cache_is_left_as_transformers_leaves_it():
    """``cache=DynamicCache()`` kept across turns: an explicit speculative call leaves it continuable; the automatic
    speculation leaves the caller's cache alone (plain decoding) and says why."""
    plain, patched = _plain_and_patched()
    ids, mask = random_batch(2, seed=5)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD)

    def two_turns(model, **extra):
        cache = DynamicCache(config=model.config)
        first = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **kwargs, **extra)
        held = cache.get_seq_length()
        grown = torch.cat([mask, torch.ones(2, first.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
        return held, model.generate(input_ids=first, attention_mask=grown, cache=cache, **kwargs, **extra)

    held, expected = two_turns(plain)
    got_held, got = two_turns(patched, prompt_lookup=True)
    assert (got_held, got.tolist()) == (held, expected.tolist())
    assert hf_accel.last_stats(patched).speculative["cache"] == "kept"
    got_held, got = two_turns(patched)
    assert (got_held, got.tolist()) == (held, expected.tolist())
    assert "a cache of the caller's (DynamicCache)" in hf_accel.last_stats(patched).speculation_skipped


def test_a_cache_holding_the_whole_input_is_a_clear_error():
    plain, patched = _plain_and_patched()
    ids = torch.randint(3, 200, (1, 9))
    cache = DynamicCache(config=patched.config)
    with torch.no_grad():
        plain(input_ids=ids, cache=cache)
    with pytest.raises(IncompatibleOptionsError, match="already holds 9 tokens and input_ids has 9"):
        patched.generate(input_ids=ids, cache=cache, max_new_tokens=4, prompt_lookup=True)
    with pytest.raises(IncompatibleOptionsError, match="input_ids holds no tokens"):
        patched.generate(input_ids=ids[:, :0], max_new_tokens=4)  # the automatic speculation too
