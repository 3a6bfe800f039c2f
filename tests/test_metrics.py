"""Per-call generation metrics on patched models: exact counts, consistent timings, memory figures."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, random_batch, tiny_model

import hf_accel
from hf_accel import NotPatchedError, PagedCache
from hf_accel.core.metrics import GenerationStats, StepClock


def test_stats_of_a_plain_call_count_exactly():
    model = hf_accel.patch_model(tiny_model("llama"), speculative=hf_accel.SpeculativeConfig())  # no auto speculation
    assert hf_accel.last_stats(model) is None
    ids, mask = random_batch(3, [5, 9, 3], seed=1)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True,
    )  # fmt: skip
    stats = out.metrics
    assert stats is hf_accel.last_stats(model)
    assert (stats.batch, stats.prompt_tokens, stats.new_tokens) == (3, 17, 21)
    assert 0 < stats.ttft_s < stats.total_s
    assert stats.tpot_p50_s <= stats.tpot_p90_s and stats.tpot_mean_s > 0
    # DynamicCache: 2 layers x (K, V) x 3 rows x 2 KV heads x (9 + 7 - 1) positions x 16 dims x 4 bytes
    assert stats.kv_bytes_reserved == 2 * 2 * 3 * 2 * 15 * 16 * 4
    assert stats.kv_bytes_used == int(stats.kv_bytes_reserved * (17 + 21) / (3 * 16))  # padding is not "used"
    assert stats.decode_tokens_per_s == pytest.approx((21 - 3) / (stats.total_s - stats.ttft_s))
    assert stats.peak_memory_bytes > 0 and stats.speculative is None


def test_rows_count_up_to_their_eos():
    model = hf_accel.patch_model(tiny_model("qwen2"))
    ids, mask = random_batch(2, [4, 6], seed=2)
    probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    eos = int(probe[0, ids.shape[1] + 1])  # row 0 stops after 2 tokens
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=PAD
    )
    rows_done = [(row[ids.shape[1] :] == eos).int().argmax().item() + 1 if (row == eos).any() else 8 for row in out]
    assert hf_accel.last_stats(model).new_tokens == sum(rows_done)


def test_paged_and_speculative_calls_report_their_own_figures():
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = random_batch(2, [20, 5], seed=3)
    cache = PagedCache(model, num_blocks=16)
    model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=4, prompt_lookup=True)
    stats = hf_accel.last_stats(model)
    assert stats.kv_bytes_reserved == 16 * cache.block_bytes
    assert stats.kv_bytes_used == 3 * cache.block_bytes  # 23 + 8 tokens at most: 2 blocks + 1 block
    assert stats.speculative["strategy"] == "prompt_lookup" and stats.speculative["tokens"] == 8


def test_last_stats_needs_a_patched_model():
    with pytest.raises(NotPatchedError, match="is not patched by hf_accel; it keeps no stats"):
        hf_accel.last_stats(tiny_model("llama"))


def test_step_clock_merges_the_stamps_of_one_speculative_step():
    clock = StepClock()
    clock.start = 0.0
    clock.stamps = [1.0, 1.00001, 1.00002, 1.5, 2.5, 2.50001]
    assert clock.intervals() == pytest.approx([0.5, 1.0])
    stats = clock.stats(batch=1, prompt_tokens=4, new_tokens=6, end=3.0)
    assert isinstance(stats, GenerationStats)
    assert stats.ttft_s == 1.0 and stats.total_s == 3.0 and stats.tpot_p50_s == pytest.approx(0.75)
    assert stats.end_to_end_tokens_per_s == 2.0 and stats.prompt_tokens_per_s == 4.0
    assert torch.equal(clock(torch.zeros(2, 3, dtype=torch.long), None), torch.zeros(2, dtype=torch.bool))
