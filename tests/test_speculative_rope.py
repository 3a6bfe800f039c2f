"""Rotary embeddings whose frequencies follow the length of each forward (Transformers' ``dynamic`` and ``longrope``):
where a verification chunk would see other frequencies than one-token steps, speculation refuses (explicit) or
leaves the call to plain decoding (the default patch's automatic speculation); elsewhere it stays exact."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import PAD, random_batch, tiny_model

import hf_accel
from hf_accel import IncompatibleOptionsError
from hf_accel.speculative.rows import length_following_rope, rope_refusal

KW = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0] * 8,
    "long_factor": [3.0] * 8,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}


def test_rope_refusal_names_the_calls_whose_chunks_would_see_other_frequencies():
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, max_position_embeddings=48)
    assert rope_refusal(plain, 40, 200) is None
    dynamic = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=48)
    assert rope_refusal(dynamic, 40, 48) is None
    assert "recomputes its frequencies at every step past 48 tokens" in rope_refusal(dynamic, 40, 49)
    assert rope_refusal(dynamic, 60, 70) is not None  # past the limit every step moves them
    long = SimpleNamespace(rope_parameters=LONGROPE, max_position_embeddings=128)
    assert rope_refusal(long, 20, 32) is None  # below the switch
    assert "switches to its long factors once a forward passes 32 tokens" in rope_refusal(long, 20, 33)
    assert rope_refusal(long, 33, 100) is None  # every forward already past it
    per_layer = SimpleNamespace(
        rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": dict(LONGROPE)},
        max_position_embeddings=128,
    )
    assert rope_refusal(per_layer, 20, 40) is not None
    assert length_following_rope(per_layer) == [("longrope", 32)] and length_following_rope(plain) == []


def _dynamic(arch: str):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return tiny_model(arch, rope_scaling=rope, max_position_embeddings=48)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dynamic_scaling_past_its_limit_decodes_as_usual_or_is_refused(arch):
    plain = _dynamic(arch)
    patched = hf_accel.patch_model(copy.deepcopy(plain))
    ids, mask = random_batch(2, [30, 45], seed=2, max_len=45)
    past = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, **KW)
    expected = plain.generate(**past)
    for paged in (False, True):
        assert torch.equal(patched.generate(**past, paged=paged), expected)
        assert "recomputes its frequencies" in hf_accel.last_stats(patched).speculation_skipped
    with pytest.raises(IncompatibleOptionsError, match="would not give the model's own tokens"):
        patched.generate(**past, prompt_lookup=True)
    within = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, **KW)
    got = patched.generate(**within, prompt_lookup=True)
    assert torch.equal(got, plain.generate(**within)) and hf_accel.last_stats(patched).speculative is not None


def test_longrope_refuses_only_calls_that_cross_its_switch():
    plain = tiny_model("phi3", rope_scaling=LONGROPE, original_max_position_embeddings=32, max_position_embeddings=128)
    patched = hf_accel.patch_model(copy.deepcopy(plain))
    draft = tiny_model("phi3", seed=4)
    for lengths, new, crosses in (([20, 28], 20, True), ([36, 40], 20, False), ([10, 20], 8, False)):
        ids, mask = random_batch(2, lengths, seed=2, max_len=40)
        call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, **KW)
        expected = plain.generate(**call)
        for extra in ({"prompt_lookup": True}, {"draft_model": draft}):
            if crosses:
                with pytest.raises(IncompatibleOptionsError, match="switches to its long factors"):
                    patched.generate(**call, **extra)
            else:
                assert torch.equal(patched.generate(**call, **extra), expected), (lengths, extra)
        assert torch.equal(patched.generate(**call, paged=True), expected)  # one token a step: exact


def test_an_engine_over_a_length_following_rope_says_requests_share_its_frequencies(caplog):
    """Requests stepped together share the longest one's frequencies (as in Transformers' batched generate): the
    Engine says so once, at construction."""
    model = hf_accel.patch_model(_dynamic("llama"))
    with caplog.at_level("WARNING", logger="hf_accel.engine"):
        hf_accel.Engine(model)
    assert [r.message for r in caplog.records if "rotary embedding" in r.message] == [
        "hf_accel: Engine: LlamaForCausalLM's rotary embedding (rope_type 'dynamic') takes its frequencies from the "
        "longest sequence in each forward past 48 tokens, so a request stepped with longer ones may get other tokens "
        "than its own generate call (as in Transformers' batched generate); call generate per request where that "
        "matters"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_accel.engine"):
        hf_accel.Engine(hf_accel.patch_model(tiny_model("llama")))
    assert not [r for r in caplog.records if "rotary embedding" in r.message]
