"""Tier (c): the continuous-batching Engine against single-request ``generate`` (tiny models and the real one)."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import EOS, VOCAB, chat_batch, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

import hf_accel
from hf_accel import Engine, EngineStoppedError, PagedConfig, RequestFailedError, UnknownRequestError
from hf_accel.core.errors import IncompatibleOptionsError, NotPatchedError
from hf_accel.speculative import PromptLookup


def prompts_of(count: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def reference(model, prompt: list[int], **kwargs) -> list[int]:
    """Single-request greedy ``generate`` (the plain, non-paged path)."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, **kwargs)
    return out[0, len(prompt) :].tolist()


def small_pool(num_blocks: int = 24, block_size: int = 4) -> PagedConfig:
    return PagedConfig(num_blocks=num_blocks, block_size=block_size, prefix_cache=True)


def assert_pool_free(engine: Engine) -> None:
    m = engine.cache.manager
    m.check_invariants()
    assert m.sequences() == []
    assert m.num_free + m.num_evictable == m.num_blocks


@pytest.fixture
def patched(arch):
    return hf_accel.patch_model(tiny_model(arch))


def test_greedy_equals_single_request_generate_every_arch(patched):
    """Chunked prefill, mixed prefill/decode steps and preemption (a 24-block pool) on every architecture."""
    prompts = prompts_of(10, seed=1)
    refs = [reference(patched, p, max_new_tokens=16, eos_token_id=None) for p in prompts]
    engine = Engine(patched, max_batch_tokens=48, max_running=5, paged=small_pool())
    ids = [engine.add_request(p, max_new_tokens=16, eos_token_id=None) for p in prompts]
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == refs
    assert engine.scheduler.preemptions > 0  # the pool was small enough to force recomputation
    assert all(outputs[i].finish_reason == "length" for i in ids)
    assert_pool_free(engine)


def test_arrival_order_and_cancellation_do_not_change_outputs():
    model = hf_accel.patch_model(tiny_model("llama"))
    prompts = prompts_of(8, seed=2)
    refs = [reference(model, p, max_new_tokens=12, eos_token_id=None) for p in prompts]
    engine = Engine(model, max_batch_tokens=32, max_running=4, paged=small_pool())
    ids, pending = {}, list(range(8))[::-1]  # reversed arrival order, one new request every other step
    cancelled = set()
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            j = pending.pop(0)
            ids[j] = engine.add_request(prompts[j], max_new_tokens=12, eos_token_id=None)
            if j in (3, 6):
                engine.cancel(ids[j])
                cancelled.add(j)
        engine.step()
        step += 1
    for j, rid in ids.items():
        out = engine.result(rid)
        if j in cancelled:
            assert out.finish_reason == "cancelled"
        else:
            assert out.tokens == refs[j], j
    assert_pool_free(engine)


def test_shared_prompt_prefix_is_computed_once():
    """A later request starting with an earlier one's prompt adopts its cached blocks and prefills the rest."""
    model = hf_accel.patch_model(tiny_model("llama"))
    system = prompts_of(1, seed=13, lo=30, hi=30)[0]
    prompts = [[*system, 7, 8, 9], [*system, 10, 11]]
    refs = [reference(model, p, max_new_tokens=6, eos_token_id=None) for p in prompts]
    engine = Engine(model, max_batch_tokens=64, max_running=4, paged=small_pool(32))
    first = engine.add_request(prompts[0], max_new_tokens=6, eos_token_id=None)
    engine.step()  # the first prompt is prefilled and its full blocks published
    second = engine.add_request(prompts[1], max_new_tokens=6, eos_token_id=None)
    engine.step()
    fed_before = engine.forward_tokens
    outputs = engine.run_until_done()
    assert [outputs[first].tokens, outputs[second].tokens] == refs
    assert engine.scheduler.prefix_hit_tokens == 28  # 7 full blocks of 4 tokens of the shared 30-token prefix
    assert fed_before == 33 + 1 + (32 - 28)  # prompt 1, its decode token, prompt 2's uncached tail


def test_eos_and_per_request_settings():
    model = hf_accel.patch_model(tiny_model("qwen3"))
    prompts = prompts_of(4, seed=3)
    settings = [
        dict(max_new_tokens=10, eos_token_id=None),
        dict(max_new_tokens=14, repetition_penalty=1.3, eos_token_id=None),
        dict(max_new_tokens=20, min_new_tokens=5, eos_token_id=EOS),
        dict(max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=None),  # top_k=1 sampling = greedy
    ]
    refs = [
        reference(model, p, **{k: v for k, v in s.items() if k not in ("do_sample", "top_k")})
        for p, s in zip(prompts, settings, strict=True)
    ]
    engine = Engine(model, max_batch_tokens=64, max_running=4, paged=small_pool(64))
    ids = [engine.add_request(p, **s) for p, s in zip(prompts, settings, strict=True)]
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == refs
    assert [len(outputs[i].tokens) for i in ids[:2]] == [10, 14]


def test_eos_stops_a_request_and_frees_its_blocks():
    model = hf_accel.patch_model(tiny_model("llama"))
    prompt = prompts_of(1, seed=4)[0]
    free_run = reference(model, prompt, max_new_tokens=12, eos_token_id=None)
    stop_at = free_run[5]
    engine = Engine(model, max_batch_tokens=64, max_running=4, paged=small_pool())
    rid = engine.add_request(prompt, max_new_tokens=12, eos_token_id=stop_at, pad_token_id=0)
    out = engine.run_until_done()[rid]
    assert out.tokens == free_run[: free_run.index(stop_at) + 1]
    assert out.finish_reason == "eos"
    assert_pool_free(engine)


def test_prompt_lookup_speculation_is_exact_and_accepts():
    model = hf_accel.patch_model(tiny_model("llama"))
    base = prompts_of(3, seed=5, lo=8, hi=12)
    prompts = [p * 4 for p in base]  # repetitive prompts: n-gram lookup finds continuations
    refs = [reference(model, p, max_new_tokens=24, eos_token_id=None) for p in prompts]
    engine = Engine(model, max_batch_tokens=64, max_running=3, paged=small_pool(64))
    ids = [engine.add_request(p, max_new_tokens=24, eos_token_id=None, prompt_lookup=True) for p in prompts]
    ids.append(engine.add_request(prompts[0], max_new_tokens=24, eos_token_id=None, speculative=PromptLookup(4)))
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == [*refs, refs[0]]
    assert sum(outputs[i].proposed for i in ids) > 0
    assert sum(outputs[i].accepted for i in ids) > 0
    assert_pool_free(engine)


def test_stream_yields_every_token_and_streamer_gets_them():
    model = hf_accel.patch_model(tiny_model("gemma2"))
    prompts = prompts_of(3, seed=6)

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    engine = Engine(model, max_batch_tokens=64, max_running=3, paged=small_pool())
    other = engine.add_request(prompts[0], max_new_tokens=9, eos_token_id=None)
    rid = engine.add_request(prompts[1], max_new_tokens=9, eos_token_id=None, streamer=streamer)
    streamed = list(engine.stream(rid))  # no background loop: iterating drives the engine
    assert streamed == reference(model, prompts[1], max_new_tokens=9, eos_token_id=None)
    assert streamer.puts[0] == [prompts[1]] and [t for (t,) in streamer.puts[1:]] == streamed and streamer.ended
    assert engine.run_until_done()[other].tokens == reference(model, prompts[0], max_new_tokens=9, eos_token_id=None)


def test_background_thread_with_producers_and_consumers():
    model = hf_accel.patch_model(tiny_model("mistral"))
    prompts = prompts_of(12, seed=7)
    refs = [reference(model, p, max_new_tokens=10, eos_token_id=None) for p in prompts]
    engine = Engine(model, max_batch_tokens=32, max_running=4, paged=small_pool()).start()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(indices):
        try:
            for j in indices:
                rid = engine.add_request(prompts[j], max_new_tokens=10, eos_token_id=None)
                results[j] = list(engine.stream(rid, timeout=60))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(range(k, 12, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engine.stop(timeout=60)
    assert not errors, errors
    assert [results[j] for j in range(12)] == refs
    assert_pool_free(engine)
    with pytest.raises(EngineStoppedError, match="this Engine was stopped; create a new one"):
        engine.add_request(prompts[0])


def test_stop_with_cancel_leaves_the_pool_free():
    model = hf_accel.patch_model(tiny_model("llama"))
    engine = Engine(model, max_batch_tokens=32, max_running=4, paged=small_pool(64)).start()
    ids = [engine.add_request(p, max_new_tokens=60, eos_token_id=None) for p in prompts_of(6, seed=8)]
    engine.stop(cancel=True, timeout=60)
    reasons = {engine.result(i).finish_reason for i in ids}
    assert reasons <= {"cancelled", "length"} and "cancelled" in reasons
    assert_pool_free(engine)


def test_failing_request_fails_alone(caplog):
    model = hf_accel.patch_model(tiny_model("llama"))
    prompts = prompts_of(3, seed=9)

    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > len(prompts[1]) + 2:
                raise ValueError("boom")
            return scores

    engine = Engine(model, max_batch_tokens=64, max_running=3, paged=small_pool())
    ids = [
        engine.add_request(
            p,
            max_new_tokens=8,
            eos_token_id=None,
            **({"logits_processor": LogitsProcessorList([Boom()])} if j == 1 else {}),
        )
        for j, p in enumerate(prompts)
    ]
    with caplog.at_level(logging.WARNING, logger="hf_accel.engine"):
        outputs = engine.run_until_done()
    assert outputs[ids[1]].finish_reason == "failed" and len(outputs[ids[1]].tokens) == 3
    with pytest.raises(RequestFailedError, match=r"request 1 failed: ValueError\('boom'\)"):
        outputs[ids[1]].raise_for_error()
    with pytest.raises(RequestFailedError, match="request 1 failed"):
        list(engine.stream(ids[1]))
    for j in (0, 2):
        assert outputs[ids[j]].tokens == reference(model, prompts[j], max_new_tokens=8, eos_token_id=None)
    assert "request 1 failed" in caplog.text
    assert_pool_free(engine)


def test_bad_input_errors():
    plain = tiny_model("llama")
    with pytest.raises(NotPatchedError, match=r"call hf_accel.patch_model\(model\) first"):
        Engine(plain)
    model = hf_accel.patch_model(plain)
    with pytest.raises(IncompatibleOptionsError, match=r"max_batch_tokens \(4\) must be >= max_running \(8\)"):
        Engine(model, max_batch_tokens=4, max_running=8)
    with pytest.raises(IncompatibleOptionsError, match=r"Engine\.max_running must be an int >= 1, got 0"):
        Engine(model, max_running=0)
    engine = Engine(model, paged=PagedConfig(num_blocks=4, block_size=4))
    with pytest.raises(IncompatibleOptionsError, match="the prompt is empty"):
        engine.add_request([])
    with pytest.raises(IncompatibleOptionsError, match=r"needs 21 KV slots but the engine's pool holds 16"):
        engine.add_request(list(range(3, 8)), max_new_tokens=16)
    with pytest.raises(IncompatibleOptionsError, match=r"outside the vocabulary \(0..255\)"):
        engine.add_request([3, 999])
    with pytest.raises(IncompatibleOptionsError, match="a text prompt needs a tokenizer"):
        engine.add_request("hello")
    with pytest.raises(IncompatibleOptionsError, match="num_beams and num_return_sequences must be 1"):
        engine.add_request([3, 4], num_beams=2)
    with pytest.raises(IncompatibleOptionsError, match=r"unknown generation options \['not_an_option'\]"):
        engine.add_request([3, 4], not_an_option=1)
    with pytest.raises(IncompatibleOptionsError, match="speculates with prompt lookup only"):
        engine.add_request([3, 4], speculative="draft")
    with pytest.raises(UnknownRequestError, match="unknown request id 42"):
        engine.cancel(42)
    with pytest.raises(UnknownRequestError, match="unknown request id 42"):
        next(engine.stream(42))
    engine.stop()
    with pytest.raises(EngineStoppedError):
        engine.add_request([3, 4])


def test_generate_many_on_a_patched_model_and_unpatch():
    model = hf_accel.patch_model(tiny_model("phi3"))
    prompts = prompts_of(5, seed=10)
    seqs = model.generate_many(prompts, max_new_tokens=7, eos_token_id=None)
    assert [s.tolist() for s in seqs] == [p + reference(model, p, max_new_tokens=7, eos_token_id=None) for p in prompts]
    hf_accel.unpatch_model(model)
    assert not hasattr(model, "generate_many")


def test_soak_200_requests_with_preemption_and_cancellations():
    """200 requests: random prompt lengths, max tokens, arrival steps and cancellations; a pool forcing preemption."""
    model = hf_accel.patch_model(tiny_model("llama"))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    max_new = [rng.randint(1, 12) for _ in range(200)]
    arrival = sorted(rng.randint(0, 300) for _ in range(200))
    cancel_at = {j: arrival[j] + rng.randint(0, 6) for j in rng.sample(range(200), 30)}
    engine = Engine(model, max_batch_tokens=40, max_running=8, paged=small_pool(20))
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < 200 or engine.has_unfinished():
        for j in range(200):
            if arrival[j] == step:
                ids[j] = engine.add_request(prompts[j], max_new_tokens=max_new[j], eos_token_id=None)
        for j, at in cancel_at.items():
            if at == step and j in ids:
                engine.cancel(ids[j])
        engine.step()
        step += 1
        assert step < 5000, "the engine stopped making progress"
    assert engine.scheduler.preemptions > 0
    for j, rid in ids.items():
        out = engine.result(rid)
        if out.finish_reason == "cancelled":
            assert j in cancel_at
            continue
        assert out.tokens == reference(model, prompts[j], max_new_tokens=max_new[j], eos_token_id=None), j
    assert_pool_free(engine)


def test_real_model_engine_matches_generate(default_model):
    model, tok = default_model
    hf_accel.patch_model(model)
    try:
        questions = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about rain."]
        batch = chat_batch(tok, questions)
        prompts = [
            ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
        ]
        refs = [reference(model, p, max_new_tokens=24) for p in prompts]
        engine = Engine(
            model, tok, max_batch_tokens=256, max_running=3, paged=PagedConfig(num_blocks=64, block_size=16)
        )
        ids = [engine.add_request(p, max_new_tokens=24) for p in prompts]
        ids.append(engine.add_request(prompts[0], max_new_tokens=24, stop_strings=["."]))
        outputs = engine.run_until_done()
        assert [outputs[i].tokens for i in ids[:3]] == refs
        stopped = reference(model, prompts[0], max_new_tokens=24, stop_strings=["."], tokenizer=tok)
        assert tok.decode(stopped).endswith(".") and len(stopped) < 24  # the reference stopped on the string
        assert outputs[ids[3]].tokens == stopped and outputs[ids[3]].finish_reason == "stop"
        assert_pool_free(engine)
    finally:
        hf_accel.unpatch_model(model)


@pytest.mark.parametrize("features", [{"int8": True}, {"compile": True}], ids=["int8", "compile"])
def test_engine_on_models_with_other_features(features):
    """The engine runs whatever the patch made of the model: int8 linears, pre-packed linears."""
    model = hf_accel.patch_model(tiny_model("llama"), **features)
    prompts = prompts_of(4, seed=12)
    refs = [reference(model, p, max_new_tokens=8, eos_token_id=None) for p in prompts]
    seqs = model.generate_many(prompts, max_new_tokens=8, eos_token_id=None)
    assert [s.tolist()[len(p) :] for s, p in zip(seqs, prompts, strict=True)] == refs


def test_script_that_never_stops_its_engine_exits_cleanly(tmp_path):
    """A background loop left running at interpreter exit ends between steps (no abort, exit code 0)."""
    script = tmp_path / "forgot_stop.py"
    script.write_text(
        "import hf_accel\n"
        "from helpers import tiny_model\n"
        "model = hf_accel.patch_model(tiny_model('llama'))\n"
        "engine = hf_accel.Engine(model, paged=hf_accel.PagedConfig(num_blocks=64, block_size=4)).start()\n"
        "for _ in range(6):\n"
        "    engine.add_request([5, 6, 7, 8] * 5, max_new_tokens=40, eos_token_id=None)\n"
        "print('leaving')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "leaving"


def test_finished_outputs_are_kept_up_to_keep_finished():
    model = hf_accel.patch_model(tiny_model("llama"))
    engine = Engine(model, max_batch_tokens=32, max_running=4, paged=small_pool(), keep_finished=3)
    ids = [engine.add_request(p, max_new_tokens=2, eos_token_id=None) for p in prompts_of(5, seed=14)]
    engine.run_until_done()
    assert [engine.result(i).finish_reason for i in ids[2:]] == ["length"] * 3  # the 3 newest are kept
    with pytest.raises(UnknownRequestError, match=r"unknown request id 0 \(never returned by add_request, or fin"):
        engine.result(ids[0])


def test_sampled_speculation_with_top_k_1_is_greedy():
    """The rejection-sampling path with drafts: top-k 1 makes p one-hot, so it must reproduce greedy exactly."""
    model = hf_accel.patch_model(tiny_model("llama"))
    prompts = [p * 4 for p in prompts_of(2, seed=15, lo=8, hi=12)]
    refs = [reference(model, p, max_new_tokens=20, eos_token_id=None) for p in prompts]
    engine = Engine(model, max_batch_tokens=64, max_running=2, paged=small_pool(64))
    kwargs = dict(max_new_tokens=20, eos_token_id=None, do_sample=True, top_k=1, prompt_lookup=True)
    ids = [engine.add_request(p, **kwargs) for p in prompts]
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == refs
    assert sum(outputs[i].accepted for i in ids) > 0  # drafts went through verify_sampling and were kept


def test_plain_greedy_requests_pick_and_stop_on_the_host():
    """Plain greedy requests take the step's argmax and stop where the max-length / EOS criteria would, without
    running them; any processor, sampling or other criterion keeps the full path. Both give generate's tokens."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from hf_accel.engine.request import build_spec

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = hf_accel.patch_model(tiny_model("llama"))
    spec = build_spec(model, 5, dict(max_new_tokens=7, eos_token_id=[EOS, 9]), None, torch.device("cpu"))
    assert spec.plain_stop == (12, frozenset({EOS, 9}))
    assert build_spec(model, 5, dict(max_new_tokens=7, eos_token_id=None), None, torch.device("cpu")).plain_stop == (
        12, frozenset())  # fmt: skip
    others = [
        dict(repetition_penalty=1.2),
        dict(do_sample=True),
        dict(stopping_criteria=StoppingCriteriaList([Never()])),
    ]
    for extra in others:
        assert build_spec(model, 5, dict(max_new_tokens=7, **extra), None, torch.device("cpu")).plain_stop is None
    prompt = prompts_of(1, seed=8)[0]
    free_run = reference(model, prompt, max_new_tokens=12, eos_token_id=None)
    engine = Engine(model, max_batch_tokens=64, max_running=4, paged=small_pool())
    plain = engine.add_request(prompt, max_new_tokens=12, eos_token_id=free_run[6], pad_token_id=0)
    full = engine.add_request(prompt, max_new_tokens=12, eos_token_id=free_run[6], pad_token_id=0,
                              stopping_criteria=StoppingCriteriaList([Never()]))  # fmt: skip
    capped = engine.add_request(prompt, max_length=len(prompt) + 4, eos_token_id=None)  # max_length, not new tokens
    outputs = engine.run_until_done()
    for rid in (plain, full):
        assert outputs[rid].tokens == free_run[: free_run.index(free_run[6]) + 1]
        assert outputs[rid].finish_reason == "eos"
    assert outputs[capped].tokens == free_run[:4]
    assert_pool_free(engine)


def test_a_seeded_request_samples_the_same_tokens_alone_or_batched_with_others():
    """``seed=``: the request's own generator, so neither the requests beside it, their arrival, nor torch's global
    seed changes what it samples (also through prompt lookup's sampled verification)."""
    model = hf_accel.patch_model(tiny_model("llama"))
    prompt = prompts_of(1, seed=21, lo=6, hi=6)[0] * 3  # repetitive: prompt lookup drafts
    kwargs = dict(max_new_tokens=16, eos_token_id=None, do_sample=True, temperature=1.0, top_k=0)

    def run(seed: int, others: int, lookup: bool, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        engine = Engine(model, max_batch_tokens=64, max_running=8, paged=small_pool(96))
        for p in prompts_of(others, seed=global_seed):
            engine.add_request(p, **kwargs)
        rid = engine.add_request(prompt, seed=seed, prompt_lookup=lookup, **kwargs)
        return engine.run_until_done()[rid].tokens

    for lookup in (False, True):
        alone = run(7, 0, lookup, 0)
        assert run(7, 5, lookup, 1) == alone and run(7, 3, lookup, 2) == alone, lookup
        assert len({tuple(run(s, 0, lookup, 0)) for s in (1, 2, 3)} | {tuple(alone)}) > 1  # the seed matters
    with pytest.raises(IncompatibleOptionsError, match=r"seed must be an int in \[-2\*\*63, 2\*\*64\), got 'x'"):
        Engine(model).add_request([3, 4], seed="x")


def test_requests_with_one_prompt_compute_it_once():
    """Several requests with the same prompt arriving together (a server's ``n`` choices, or a burst with one system
    prompt): the first computes the prompt, the others adopt its blocks; outputs equal ``generate``."""
    model = hf_accel.patch_model(tiny_model("llama"))
    prompt = prompts_of(1, seed=30, lo=40, hi=40)[0]
    want = reference(model, prompt, max_new_tokens=6, eos_token_id=None)
    engine = Engine(model, paged=PagedConfig(num_blocks=64, block_size=8, prefix_cache=True))
    ids = [engine.add_request(prompt, max_new_tokens=6, eos_token_id=None) for _ in range(4)]
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == [want] * 4
    assert engine.scheduler.prefix_hit_tokens == 3 * 32  # 39 tokens to look up: 4 blocks of 8, three times
    assert engine.forward_tokens == 40 + 3 * 8 + 4 * 5  # the prompt once, each twin its last 8, then 5 steps each
    assert_pool_free(engine)


def test_logprobs_are_the_models_own_for_every_kept_token_also_through_drafts():
    """``logprobs=k``: each generated token's log-softmax of the raw logits where it was chosen, and the ``k``
    likeliest tokens there; equal to a plain forward over the finished sequence, with and without prompt lookup."""
    model = hf_accel.patch_model(tiny_model("llama"))
    prompt = prompts_of(2, seed=15, lo=8, hi=12)[0] * 4  # the greedy output repeats it: drafts are accepted
    engine = Engine(model, paged=small_pool(96))
    kwargs = dict(max_new_tokens=20, eos_token_id=None, logprobs=3)
    ids = [engine.add_request(prompt, **kwargs), engine.add_request(prompt, prompt_lookup=True, **kwargs),
           engine.add_request(prompt, do_sample=True, temperature=0.7, seed=4, **kwargs)]  # fmt: skip
    outputs = engine.run_until_done()
    assert outputs[ids[1]].accepted > 0  # drafts were kept: their entries come from the verification chunk
    for rid in ids:
        out = outputs[rid]
        with torch.no_grad():
            logits = model(torch.tensor([out.prompt + out.tokens])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1)  # [20, V]
        assert [e.token for e in out.logprobs] == out.tokens and all(len(e.top) == 3 for e in out.logprobs)
        got = torch.tensor([e.logprob for e in out.logprobs])
        torch.testing.assert_close(got, want.gather(1, torch.tensor(out.tokens)[:, None])[:, 0], atol=1e-4, rtol=0)
        assert [[t for t, _ in e.top] for e in out.logprobs] == want.topk(3, -1).indices.tolist()
    assert engine.result(engine.add_request(prompt, max_new_tokens=2)).logprobs is None
    with pytest.raises(IncompatibleOptionsError, match=r"logprobs must be an int >= 0 \(alternatives per token\)"):
        engine.add_request(prompt, logprobs=-1)
