"""Tier (c) and the cache contract: ``PagedCache`` in ``generate`` against Transformers' DynamicCache."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHS,
    EOS,
    NO_AUTO_SPECULATION,
    PAD,
    assert_close,
    chat_batch,
    random_batch,
    sink_logits,
    tiny_model,
)
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import hf_accel
from hf_accel import CacheFullError, IncompatibleOptionsError, PagedCache, PagedConfig
from hf_accel.kernels.ops import choose
from hf_accel.paged.layer import PagedLayer

# block_size 16: lengths shorter than a block, exactly one, just past one, and several
KERNEL = choose("paged_attention", "cpu")
BATCHES = {1: [5], 3: [3, 17, 33], 8: [1, 7, 15, 16, 17, 31, 33, 40]}


def _pair(arch: str, **overrides):
    plain = tiny_model(arch, **overrides)
    patched = hf_accel.patch_model(tiny_model(arch, **overrides), **NO_AUTO_SPECULATION)  # the paged path itself
    return plain, patched


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_greedy_identical_to_dynamic_cache(arch, batch):
    plain, patched = _pair(arch)
    ids, mask = random_batch(batch, BATCHES[batch], seed=batch)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)  # every row runs the full length
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    cache = PagedCache(patched, num_blocks=64)
    got = patched.generate(input_ids=ids, attention_mask=mask, cache=cache, **kwargs)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert stats["prompt_tokens"] == sum(BATCHES[batch])  # padding is never stored
    assert stats["live_tokens"] == sum(BATCHES[batch]) + batch * 11  # the last token is never fed back


@pytest.mark.parametrize(
    "arch", ["gemma2", "gemma3_text", "mistral", "ministral", "olmo3", "cohere2", "exaone4", "gpt_oss"]
)
@pytest.mark.parametrize("attention", ["kernel", "gather"])
def test_sliding_window_and_softcap_layers(arch, attention):
    if attention == "kernel" and not KERNEL.native:
        pytest.skip(str(KERNEL.rejected))
    plain, patched = _pair(arch, sliding_window=8)  # windows smaller than the prompts and blocks
    ids, mask = random_batch(3, [3, 17, 33], seed=4)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = patched.generate(input_ids=ids, attention_mask=mask, cache=PagedCache(patched, attention=attention), **kwargs)
    assert torch.equal(got, expected)


def test_geometries_the_kernel_does_not_take_fall_back_to_gather():
    # head_dim 12 (not a multiple of 8) and blocks of 80 tokens (> 64): 'auto' gathers, 'kernel' refuses
    plain, patched = _pair("llama", head_dim=12)
    ids, mask = random_batch(2, [5, 90], seed=2)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    for cache in (PagedCache(patched), PagedCache(patched, block_size=80)):
        assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, cache=cache, **kwargs), expected)
    if KERNEL.native:
        with pytest.raises(IncompatibleOptionsError, match="head_dim 12 is not a multiple of 8"):
            PagedCache(patched, attention="kernel")


def test_decode_reads_the_pool_without_gathering(monkeypatch):
    if not KERNEL.native:
        pytest.skip(str(KERNEL.rejected))
    _, patched = _pair("llama")
    gathered: list[int] = []
    original = PagedLayer.context

    def spy(self, row, step):
        gathered.append(step.q_len)
        return original(self, row, step)

    monkeypatch.setattr(PagedLayer, "context", spy)
    ids, mask = random_batch(2, [20, 9], seed=1)
    patched.generate(input_ids=ids, attention_mask=mask, cache=PagedCache(patched), max_new_tokens=6, do_sample=False)
    assert gathered == []  # fresh prefills attend over their own chunk; decode steps read the pool in place


def test_logits_match_dynamic_cache_step_by_step():
    plain, patched = _pair("qwen2")
    ids, mask = random_batch(3, [4, 18, 11], seed=2)
    ref, paged = DynamicCache(), PagedCache(patched)
    paged.start(ids, mask)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = plain(input_ids=ids, attention_mask=mask, position_ids=pos, cache=ref).logits
        b = patched(input_ids=ids, attention_mask=mask, position_ids=pos, cache=paged).logits
        real = mask.bool()
        # fp32; fused MLP and per-row attention only change rounding
        assert_close(b[real], a[real], atol=2e-5, rtol=1e-5, name="prefill")
        for _ in range(3):
            nxt = a[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            pos = pos[:, -1:] + 1
            a = plain(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=ref).logits
            b = patched(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=paged).logits
            assert_close(b, a, atol=2e-5, rtol=1e-5, name="decode")  # fp32
    assert paged.get_seq_length() == ref.get_seq_length() == 21


def test_dense_copy_lays_each_row_out_as_the_mask_says():
    """``PagedCache.dense``: every layer's pooled K/V, padded like the prompt (a draft's cache is seeded from it),
    equal to what Transformers' cache holds at the real positions and zero elsewhere; small blocks so rows span
    several."""
    plain, patched = _pair("qwen2")
    ids, mask = random_batch(3, [4, 18, 11], seed=2)
    ref, paged = DynamicCache(), PagedCache(patched, block_size=4, prefix_cache=False)
    paged.start(ids, mask)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        plain(input_ids=ids, attention_mask=mask, position_ids=pos, cache=ref)
        patched(input_ids=ids, attention_mask=mask, position_ids=pos, cache=paged)
    real = mask.bool()
    for layer in range(2):
        keys, values = paged.dense(layer, mask)
        assert keys.shape == values.shape == ref.layers[layer].keys.shape  # [B, H_kv, T, D]
        for got, expected in ((keys, ref.layers[layer].keys), (values, ref.layers[layer].values)):
            got, expected = got.transpose(1, 2), expected.transpose(1, 2)  # [B, T, H_kv, D]
            assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5, name="K/V")  # fp32, attention rounding
            assert not got[~real].any()
    with pytest.raises(ValueError, match="row 0 holds 4 tokens but its mask has 5 positions"):
        paged.dense(0, torch.ones(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"dense needs a \[3, T\] mask, got \(2, 18\)"):
        paged.dense(0, mask[:2])


def test_seeded_sampling_and_num_return_sequences_share_the_prompt():
    plain, patched = _pair("llama")
    ids, mask = random_batch(2, [20, 35], seed=3)
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, num_return_sequences=3)
    torch.manual_seed(11)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    seen = []

    class Watch(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            seen.append(cache.stats()["blocks_shared"])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    cache = PagedCache(patched, prefix_cache=False)
    torch.manual_seed(11)
    got = patched.generate(
        input_ids=ids, attention_mask=mask, cache=cache, stopping_criteria=StoppingCriteriaList([Watch()]), **kwargs
    )
    assert torch.equal(got, expected)
    # the three copies of each prompt share its full blocks: 1 of row 0 (20 tokens), 2 of row 1 (35 tokens)
    assert seen[0] == 3


def test_beam_search_matches(arch):
    plain, patched = _pair(arch)
    ids, mask = random_batch(2, [6, 19], seed=5)
    kwargs = dict(max_new_tokens=8, do_sample=False, num_beams=4, num_return_sequences=2)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = patched.generate(input_ids=ids, attention_mask=mask, paged=True, **kwargs)
    assert torch.equal(got, expected)


def test_prefix_cache_across_calls_prefills_only_the_suffix():
    plain, patched = _pair("llama")
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 256, (40,), generator=gen)
    prompts = [torch.cat([system, torch.randint(3, 256, (n,), generator=gen)])[None] for n in (5, 9)]
    cache = PagedCache(patched, num_blocks=32, prefix_cache=True)
    fed: list[int] = []
    hook = patched.model.embed_tokens.register_forward_hook(lambda m, i, o: fed.append(i[0].shape[1]))
    outputs = [patched.generate(input_ids=p, cache=cache, max_new_tokens=6, do_sample=False) for p in prompts]
    hook.remove()
    for p, out in zip(prompts, outputs, strict=True):
        assert torch.equal(out, plain.generate(input_ids=p, max_new_tokens=6, do_sample=False))
    assert fed[0] == 45  # first call: the whole prompt
    assert fed[6] == 49 - 32  # second call: 2 full blocks (32 tokens) of the system prompt came from the cache
    assert cache.stats()["prefix_hit_tokens"] == 32
    # the same prompt again: everything but the last block-aligned part is reused, output unchanged
    again = patched.generate(input_ids=prompts[1], cache=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(again, outputs[1])


def test_patched_model_keeps_its_own_prefix_cache_when_asked():
    plain, _ = _pair("qwen3")
    patched = hf_accel.patch_model(tiny_model("qwen3"), paged=PagedConfig(prefix_cache=True, num_blocks=40))
    ids = torch.randint(3, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    first = patched.generate(input_ids=ids, max_new_tokens=5, do_sample=False, paged=True)
    second = patched.generate(input_ids=ids, max_new_tokens=5, do_sample=False, paged=True)
    assert torch.equal(first, second)
    assert torch.equal(first, plain.generate(input_ids=ids, max_new_tokens=5, do_sample=False))
    cache = hf_accel.patch_report(patched)  # the cache is internal; its effect is visible in its stats
    ((_, pool),) = patched.__dict__["_hf_accel_state"].extras["paged_caches"].values()  # (layout, pool)
    (kept,) = pool.idle()  # one cache, made once and given back after each call
    assert kept.stats()["prefix_hit_tokens"] == 48 and cache["features"]["paged"]["prefix_cache"] is True
    assert pool.made == 1


def test_rows_that_finish_early_release_their_blocks():
    plain, patched = _pair("llama")
    ids, mask = random_batch(3, [5, 30, 12], seed=6)
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(probe[0, ids.shape[1] + 2])  # row 0 emits this token at its 3rd step: make it the EOS
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    released = []
    cache = PagedCache(patched, num_blocks=32, prefix_cache=False)

    class Watch(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            released.append([cache.released(r) for r in range(3)])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    got = patched.generate(
        input_ids=ids,
        attention_mask=mask,
        cache=cache,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        stopping_criteria=StoppingCriteriaList([Watch()]),
    )
    assert torch.equal(got, expected)
    finished_at = (expected[:, ids.shape[1] :] == eos).int().argmax(1)
    assert int(finished_at[0]) == 2
    assert released[4][0] is True  # row 0's blocks went back to the pool while other rows kept going
    assert not all(released[4])


# ------------------------------------------------------------------------------------ cache contract
def test_crop_reorder_select_and_reset():
    _, patched = _pair("llama")
    cache = PagedCache(patched, num_blocks=16, block_size=4, prefix_cache=False)
    ids, mask = random_batch(2, [6, 10], seed=0)
    cache.start(ids, mask)
    with torch.no_grad():
        patched(input_ids=ids, attention_mask=mask, cache=cache)
    assert cache.get_seq_length() == 10
    assert cache.stats()["blocks_used"] == 2 + 3 and cache.stats()["live_tokens"] == 16
    cache.crop(-3)  # speculative rollback frees the emptied blocks
    assert cache.get_seq_length() == 7 and cache.stats()["live_tokens"] == 10
    assert cache.stats()["blocks_used"] == 1 + 2
    with pytest.raises(ValueError, match="cannot remove 4 tokens from a row that holds 3 real tokens"):
        cache.crop(-4)
    cache.reorder_cache(torch.tensor([1, 1]))  # both rows now share row 1's table
    assert cache.stats()["blocks_shared"] == 2 and cache.stats()["blocks_used"] == 2
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4 and cache.stats()["blocks_used"] == 2
    cache.batch_select_indices(torch.tensor([0]))
    assert cache.batch_size == 1 and cache.stats()["blocks_shared"] == 0
    cache.reset()
    assert cache.stats()["blocks_free"] == 16 and cache.get_seq_length() == 0
    assert cache.get_mask_sizes(5) == (5, 0)
    cache.manager.check_invariants()


def test_repr_and_sizing_from_a_memory_budget():
    _, patched = _pair("llama")
    # 2 layers x 16 tokens x (K+V) x 2 heads x 16 dims x 4 bytes = 8 KiB per block
    cache = PagedCache(patched, max_memory=100 * 8192 + 5)  # a limit: the pool starts with one block
    assert cache.limit_blocks == 100 and cache.num_blocks == 1 and cache.max_tokens == 16
    cache.reserve([1600], "a test")
    assert cache.num_blocks == 100 and cache.max_tokens == 1600
    assert repr(cache) == (
        "PagedCache(model_type='llama', layers=2, blocks=100, block_size=16, tokens=1600, reserved=0.8 MiB, "
        "dtype=float32, rows=0, seq_length=0, sizing='100 blocks reserved for a test; may grow up to 100 blocks "
        "(max_memory=819205 bytes)')"
    )
    assert cache.layers[0].keys.shape == (100, 16, 2, 16)
    assert cache.stats()["bytes_reserved"] == cache.stats()["bytes_limit"] == 100 * 8192


# ----------------------------------------------------------------------------------------- bad input
def test_bad_sizes_are_clear_errors():
    _, patched = _pair("llama")
    with pytest.raises(IncompatibleOptionsError) as info:
        PagedCache(patched, block_size=0)
    assert str(info.value) == "PagedCache.block_size must be an int >= 1, got 0"
    with pytest.raises(IncompatibleOptionsError) as info:
        PagedCache(patched, max_memory=1000)
    assert str(info.value) == (
        "PagedCache.max_memory=1000 bytes holds no block: one block of 16 tokens over 2 layers takes 8192 bytes"
    )
    with pytest.raises(IncompatibleOptionsError, match=r"PagedCache\.attention must be one of"):
        PagedCache(patched, attention="flash")


def test_pool_too_small_for_the_prompts():
    _, patched = _pair("llama")
    ids, mask = random_batch(2, [20, 20], seed=0)
    with pytest.raises(CacheFullError) as info:
        patched.generate(input_ids=ids, attention_mask=mask, cache=PagedCache(patched, num_blocks=3), max_new_tokens=2)
    assert "the 2 prompts alone need 4 blocks of 16 tokens but the pool has 3" in str(info.value)
    assert info.value.needed == 4 and info.value.free == 3


def test_pool_exhausted_while_decoding_is_an_error_not_a_truncation():
    _, patched = _pair("llama")
    ids, mask = random_batch(2, [15, 15], seed=0)
    cache = PagedCache(patched, num_blocks=2, prefix_cache=False)
    with pytest.raises(CacheFullError) as info:
        patched.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=5, eos_token_id=None)
    assert "this step needs 2 more blocks of 16 tokens for 2 rows but 0 are free (2 total)" in str(info.value)


def test_misuse_errors():
    plain, patched = _pair("llama")
    other = hf_accel.patch_model(tiny_model("llama"))
    ids, _ = random_batch(1, [6], seed=0)
    with pytest.raises(IncompatibleOptionsError, match="this PagedCache was built for another model"):
        patched.generate(input_ids=ids, cache=PagedCache(other), max_new_tokens=2)
    with pytest.raises(IncompatibleOptionsError) as info:
        plain.generate(input_ids=ids, cache=PagedCache(plain), max_new_tokens=2)
    assert "patch the model first: hf_accel.patch_model(model)" in str(info.value)
    right = torch.tensor([[5, 6, 7, PAD]]), torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(IncompatibleOptionsError, match="PagedCache needs left padding: row 0"):
        patched.generate(input_ids=right[0], attention_mask=right[1], cache=PagedCache(patched), max_new_tokens=2)
    with pytest.raises(IncompatibleOptionsError, match="do not also pass cache="):
        patched.generate(input_ids=ids, cache=PagedCache(patched), paged=True, max_new_tokens=2)
    with pytest.raises(IncompatibleOptionsError, match="takes True, a PagedConfig or a PagedCache, got str"):
        patched.generate(input_ids=ids, paged="yes", max_new_tokens=2)


def test_dtype_mismatch_is_caught():
    _, patched = _pair("llama")
    cache = PagedCache(patched)  # fp32 pools
    patched.to(torch.bfloat16)
    ids, _ = random_batch(1, [6], seed=0)
    with pytest.raises(IncompatibleOptionsError) as info:
        patched.generate(input_ids=ids, cache=cache, max_new_tokens=2)
    assert str(info.value) == (
        "PagedCache layer 0 holds torch.float32 on cpu, but the model produced torch.bfloat16 on cpu; "
        "build the cache after moving/casting the model"
    )


def test_unpatch_restores_attention_and_plain_generate_is_untouched():
    plain, patched = _pair("gemma2")
    assert patched.config._attn_implementation == "hf_accel_paged:eager"
    ids, mask = random_batch(3, [4, 9, 2], seed=8)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    # without paged=, the patched model runs its base attention (and Transformers' own cache)
    assert torch.equal(
        patched.generate(input_ids=ids, attention_mask=mask, **kwargs),
        plain.generate(input_ids=ids, attention_mask=mask, **kwargs),
    )
    hf_accel.unpatch_model(patched)
    assert patched.config._attn_implementation == "eager"


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_plain_generate_of_an_sdpa_model_skips_the_grouped_kv_copies(monkeypatch, cache_implementation):
    import transformers.integrations.sdpa_attention as sdpa

    plain = tiny_model("llama")  # sdpa, 4 query heads sharing 2 K/V heads; the model's own forward (no executor):
    patched = hf_accel.patch_model(tiny_model("llama"), native=False, **NO_AUTO_SPECULATION)  # the same SDPA maths
    assert plain.config._attn_implementation == "sdpa" and plain.config.num_key_value_heads == 2
    copies, seen = [], []
    repeat_kv = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: copies.append(h.shape) or repeat_kv(h, n))

    class Spy:  # a logits processor that records the model's attention setting during the call
        def __call__(self, ids, scores):
            seen.append(patched.config._attn_implementation)
            return scores

    ids, mask = random_batch(3, [4, 9, 2], seed=8)  # left padding: the prompt is a masked multi-query chunk
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    kwargs.update(cache_implementation=cache_implementation)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert copies  # Transformers' own sdpa copies the grouped K/V for the padded prompt
    copies.clear()
    got = patched.generate(input_ids=ids, attention_mask=mask, logits_processor=[Spy()], **kwargs)
    # the shared config never changes during a call (other threads' paged calls rely on it); the paged function
    # hands K/V that are not a PagedCache's to the grouped-query SDPA without copies
    assert seen == ["hf_accel_paged:sdpa"] * 6 and copies == []
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.scores, expected.scores, strict=True)):
        assert torch.equal(a, b), f"step {step}: scores differ"  # bitwise: the same SDPA maths without copies
    assert patched.config._attn_implementation == "hf_accel_paged:sdpa"


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_eos_token_in_every_row_ends_generation(arch):
    plain, patched = _pair(arch)
    ids, mask = random_batch(2, [3, 8], seed=9)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, paged=True, **kwargs), expected)


def test_real_model_paged_greedy_identical(default_model):
    model, tokenizer = default_model
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea, then explain it line by line.",
        "List three uses of a paperclip.",
    ]
    inputs = chat_batch(tokenizer, prompts)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        expected = model.generate(**inputs, **kwargs)
        hf_accel.patch_model(model, fused_mlp=False)
        try:
            cache = PagedCache(model, max_memory=64 << 20)
            got = model.generate(**inputs, cache=cache, **kwargs)
        finally:
            hf_accel.unpatch_model(model)
    assert torch.equal(got, expected)
    assert cache.stats()["prompt_tokens"] == int(inputs["attention_mask"].sum())


@pytest.mark.parametrize("attention", ["auto", "batched", "gather"])
def test_attention_sinks_in_every_paged_path(attention):
    """GPT-OSS passes its sinks to the attention function as ``s_aux``: every paged path takes them into its softmax
    (logits of a prompt and of the next step as the unpatched model's, and the same greedy tokens), at Transformers'
    default init with sinks that matter (some heads' sinks take most of the softmax)."""
    plain, patched = _pair("gpt_oss", initializer_range=0.02)
    for model in (plain, patched):
        for layer in model.model.layers:
            with torch.no_grad():
                layer.self_attn.sinks.copy_(sink_logits(layer.self_attn.sinks.numel()))
    ids, mask = random_batch(3, [3, 17, 11], seed=5)  # longer than the sliding layers' window of 6
    cache = PagedCache(patched, attention=attention)
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
        real = mask.bool()
        assert_close(got[real], want[real], atol=1e-5, rtol=1e-4, name="prompt logits")  # fp32
        step = torch.full((3, 1), 7)
        wider = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        want = plain(input_ids=torch.cat([ids, step], 1), attention_mask=wider).logits[:, -1]
        got = patched(input_ids=step, attention_mask=wider, cache=cache, use_cache=True).logits[:, -1]
        assert_close(got, want, atol=1e-5, rtol=1e-4, name="decode logits")
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = patched.generate(input_ids=ids, attention_mask=mask, cache=PagedCache(patched, attention=attention), **kwargs)
    assert torch.equal(got, expected)
