"""A patched model follows what its user does to it: ``model.to(dtype)`` after patching, then generate and
unpatch; and a paged cache that reserves what a call needs instead of a fixed share of memory (issue 30, items 8, 15).
"""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, random_batch, tiny_model

import hf_accel
from hf_accel import Engine, PagedCache, PagedConfig
from hf_accel.core.errors import CacheFullError

KW = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=PAD)
FEATURES = {"default": {}, "compile": {"compile": True}, "native": {"native": True}}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_generate_and_unpatch_after_casting_the_patched_model(feature):
    ids, mask = random_batch(2, [7, 4], seed=3)
    reference = tiny_model("llama").to(torch.bfloat16)
    want = reference.generate(input_ids=ids, attention_mask=mask, **KW)
    model = hf_accel.patch_model(tiny_model("llama"), **FEATURES[feature])
    model.generate(input_ids=ids, attention_mask=mask, paged=True, **KW)  # a kept float32 cache exists now
    model.to(torch.bfloat16)
    # what the same features give on a model cast before patching (bf16 paged attention sums in another order
    # than the dense one, so it is compared with itself)
    cast_first = hf_accel.patch_model(tiny_model("llama").to(torch.bfloat16), **FEATURES[feature])
    for extra in ({}, {"paged": True}, {"prompt_lookup": True}):
        got = model.generate(input_ids=ids, attention_mask=mask, **extra, **KW)
        assert torch.equal(got, cast_first.generate(input_ids=ids, attention_mask=mask, **extra, **KW)), extra
    hf_accel.unpatch_model(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **KW), want)
    for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_int8_unpatch_restores_linears_in_the_models_current_dtype():
    ids, mask = random_batch(2, [7, 4], seed=3)
    reference = tiny_model("llama").to(torch.bfloat16)
    model = hf_accel.patch_model(tiny_model("llama"), int8=hf_accel.Int8Config(keep_original=True))
    model.to(torch.bfloat16)
    model.generate(input_ids=ids, attention_mask=mask, paged=True, **KW)
    hf_accel.unpatch_model(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    want = reference.generate(input_ids=ids, attention_mask=mask, **KW)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **KW), want)


def test_kept_caches_are_rebuilt_for_the_models_new_dtype():
    model = hf_accel.patch_model(tiny_model("qwen3"))
    ids, mask = random_batch(1, [9], seed=1)
    model.generate(input_ids=ids, attention_mask=mask, paged=True, **KW)
    pools = model.__dict__["_hf_accel_state"].extras["paged_caches"]
    ((layout, pool),) = pools.values()
    assert layout[0] == torch.float32 and pool.idle()[0].dtype == torch.float32
    model.to(torch.bfloat16)
    model.generate(input_ids=ids, attention_mask=mask, paged=True, **KW)
    ((layout, pool),) = pools.values()  # the float32 pool is gone, not kept beside the new one
    assert layout[0] == torch.bfloat16 and [c.dtype for c in pool.idle()] == [torch.bfloat16]


# ------------------------------------------------------------------------------------ item 15: pool sizing
def test_a_generate_cache_reserves_what_the_call_needs_and_grows_for_a_bigger_one():
    model = hf_accel.patch_model(tiny_model("llama"), paged=PagedConfig(block_size=4))
    plain = tiny_model("llama")
    ids, mask = random_batch(3, [9, 5, 2], seed=2)
    out = model.generate(input_ids=ids, attention_mask=mask, paged=True, **KW)
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **KW))
    ((_, pool),) = model.__dict__["_hf_accel_state"].extras["paged_caches"].values()
    (cache,) = pool.idle()
    # rows of 9, 5 and 2 real prompt tokens, 6 new each: ceil(15/4) + ceil(11/4) + ceil(8/4) = 4 + 3 + 2 blocks
    assert cache.num_blocks == 9 and cache.layers[0].keys.shape[0] == 9
    stats = cache.stats()
    assert stats["bytes_reserved"] == 9 * cache.block_bytes and stats["blocks_limit"] > 1000
    assert stats["sizing"].startswith("9 blocks reserved for 3 rows x (prompt + max_new_tokens); may grow up to")
    assert "sizing='9 blocks reserved" in repr(cache)
    ids, mask = random_batch(2, [30, 3], seed=4)
    out = model.generate(input_ids=ids, attention_mask=mask, paged=True, **{**KW, "max_new_tokens": 12})
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **{**KW, "max_new_tokens": 12}))
    assert cache.num_blocks == 11 + 4 and pool.made == 1  # the same cache, grown: ceil(42/4) + ceil(15/4)


def test_a_forward_that_needs_more_grows_the_pool_up_to_its_limit_and_keeps_stored_blocks():
    model = hf_accel.patch_model(tiny_model("llama"))
    plain = tiny_model("llama")
    cache = PagedCache(model, block_size=4, max_memory=12 * 4 * 2 * 2 * 16 * 4 * 2)  # 12 blocks at most
    assert (cache.num_blocks, cache.limit_blocks) == (1, 12)
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a raw forward (no generate, nothing reserved): the pool grows as the tokens arrive
        first = model(input_ids=ids[:, :6], cache=cache, use_cache=True).logits
        second = model(input_ids=ids[:, 6:], cache=cache, use_cache=True).logits
        want = plain(input_ids=ids).logits
    torch.testing.assert_close(torch.cat([first, second], 1), want, rtol=1e-5, atol=1e-5)
    assert cache.num_blocks == 3 and cache.stats()["sizing"].startswith("grown to 3 blocks when a forward needed")
    long = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(1))
    with pytest.raises(CacheFullError, match="15 blocks needed, 12 free"):
        cache.start(long)


def test_a_fixed_pool_never_grows_and_the_engine_reserves_its_budget():
    model = hf_accel.patch_model(tiny_model("llama"))
    cache = PagedCache(model, num_blocks=2, block_size=4)
    assert not cache.grows and cache.stats()["sizing"] == "2 blocks reserved (num_blocks=2)"
    with pytest.raises(CacheFullError):
        model.generate(input_ids=torch.arange(3, 20)[None], paged=cache, **KW)
    assert cache.num_blocks == 2
    engine = Engine(model, paged=PagedConfig(block_size=4, max_memory="1MiB", prefix_cache=True))
    assert engine.cache.num_blocks == engine.cache.limit_blocks == (1 << 20) // engine.cache.block_bytes
