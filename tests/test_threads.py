"""Threaded stress (bounded): concurrent ``generate`` calls on one patched model, every feature, each output equal
to the same call run alone; an ``Engine`` serving beside plain ``generate``; a Strategy instance shared by two
calls gets a typed error."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from helpers import PAD, random_batch, run_threads, tiny_model

import hf_accel
from hf_accel import Engine, PagedConfig, SpeculativeConfig
from hf_accel.core.errors import IncompatibleOptionsError
from hf_accel.speculative import PromptLookup

THREADS, CALLS = 4, 3
KW = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=PAD)


def _features(draft: torch.nn.Module) -> dict[str, dict[str, Any]]:
    return {
        "plain": {},
        "paged": {"paged": True},
        "paged_prefix": {"paged": PagedConfig(num_blocks=64, block_size=4, prefix_cache=True)},
        "prompt_lookup": {"prompt_lookup": True},
        "lookup_paged": {"prompt_lookup": True, "paged": True},
        "draft_model": {"draft_model": draft},
        "self": {"speculative": SpeculativeConfig(strategy="self", num_tokens=3)},
    }


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = random_batch(2, lengths=[5 + i % 4, 9], seed=100 + i)
    return torch.cat([ids, ids[:, -5:]], 1), torch.cat([mask, mask[:, -5:]], 1)  # a repeat: lookup proposes


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_concurrent_generate_of_every_feature_equals_its_single_threaded_run(arch):
    plain = tiny_model(arch)
    model = hf_accel.patch_model(tiny_model(arch), native=True)
    features = _features(tiny_model("qwen2", seed=3))
    jobs = [(name, i) for name in features for i in range(2)]
    expected = {}
    for name, i in jobs:
        ids, mask = _batch(i)
        expected[name, i] = model.generate(input_ids=ids, attention_mask=mask, **features[name], **KW)
        assert torch.equal(expected[name, i], plain.generate(input_ids=ids, attention_mask=mask, **KW)), name
    got: dict[tuple[str, int, int], torch.Tensor] = {}

    def worker(t: int) -> None:
        for c in range(CALLS * len(jobs) // THREADS):
            name, i = jobs[(t * 5 + c * 3) % len(jobs)]  # every thread a different mix: plain beside paged etc.
            ids, mask = _batch(i)
            got[name, i, t * 100 + c] = model.generate(input_ids=ids, attention_mask=mask, **features[name], **KW)

    run_threads([lambda t=t: worker(t) for t in range(THREADS)])
    assert len(got) == THREADS * (CALLS * len(jobs) // THREADS)
    wrong = [key for key, out in got.items() if not torch.equal(out, expected[key[:2]])]
    assert not wrong, f"outputs that differ from the single-threaded run: {wrong}"
    hf_accel.unpatch_model(model)


def test_engine_serves_while_plain_and_paged_generate_run_beside_it():
    model = hf_accel.patch_model(tiny_model("llama"))
    prompts = [_batch(i)[0][0][-8:].tolist() for i in range(8)]
    refs = [model.generate(torch.tensor([p]), **KW)[0, len(p) :].tolist() for p in prompts]
    batches = [_batch(i) for i in range(3)]
    side = [model.generate(input_ids=ids, attention_mask=mask, **KW) for ids, mask in batches]
    engine = Engine(model, max_batch_tokens=32, max_running=4, paged=PagedConfig(num_blocks=48, block_size=4))
    engine.start()
    results: dict[int, list[int]] = {}

    def client(k: int) -> None:
        for j in range(k, len(prompts), 2):
            rid = engine.add_request(prompts[j], max_new_tokens=10, eos_token_id=None)
            results[j] = list(engine.stream(rid, timeout=120))

    def beside(paged: bool) -> None:
        for _ in range(3):
            for (ids, mask), ref in zip(batches, side, strict=True):
                out = model.generate(input_ids=ids, attention_mask=mask, paged=paged, **KW)
                assert torch.equal(out, ref)

    try:
        run_threads([lambda: client(0), lambda: client(1), lambda: beside(False), lambda: beside(True)])
    finally:
        engine.stop(timeout=60)
    assert [results[j] for j in range(len(prompts))] == refs


class _Gated(PromptLookup):
    """Prompt lookup whose first proposal waits for the test (the call holds the strategy meanwhile)."""

    def __init__(self) -> None:
        super().__init__(num_tokens=2)
        self.entered, self.go = threading.Event(), threading.Event()

    def propose(self, sequences, budgets):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.go.wait(60)
        return super().propose(sequences, budgets)


def test_a_strategy_instance_serving_a_call_is_refused_to_a_second_thread():
    plain = tiny_model("llama")
    model = hf_accel.patch_model(tiny_model("llama"))
    strategy = _Gated()
    ids, mask = _batch(0)
    first: list[torch.Tensor] = []
    thread = threading.Thread(
        target=lambda: first.append(model.generate(input_ids=ids, attention_mask=mask, speculative=strategy, **KW))
    )
    thread.start()
    try:
        assert strategy.entered.wait(60)
        with pytest.raises(IncompatibleOptionsError, match=r"serving another generate call.*its own instance"):
            model.generate(input_ids=ids, attention_mask=mask, speculative=strategy, **KW)
    finally:
        strategy.go.set()
        thread.join(60)
    assert torch.equal(first[0], plain.generate(input_ids=ids, attention_mask=mask, **KW))
    again = model.generate(input_ids=ids, attention_mask=mask, speculative=strategy, **KW)  # free again
    assert torch.equal(again, first[0])


class _Gate:
    """A logits processor (scores unchanged) that holds its call at the first step until the test lets it go."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.go.wait(60)
        return scores


def test_a_user_paged_cache_serving_a_call_is_refused_to_a_second_thread():
    from transformers import LogitsProcessorList

    plain = tiny_model("llama")
    model = hf_accel.patch_model(tiny_model("llama"))
    cache = hf_accel.PagedCache(model, block_size=4)
    gate = _Gate()
    ids, mask = _batch(1)
    first: list[torch.Tensor] = []
    call = dict(input_ids=ids, attention_mask=mask, paged=cache, **KW)
    thread = threading.Thread(
        target=lambda: first.append(model.generate(**call, logits_processor=LogitsProcessorList([gate])))
    )
    thread.start()
    try:
        assert gate.entered.wait(60)
        with pytest.raises(IncompatibleOptionsError, match=r"PagedCache is serving another generate call"):
            model.generate(**call)
    finally:
        gate.go.set()
        thread.join(60)
    want = plain.generate(input_ids=ids, attention_mask=mask, **KW)
    assert torch.equal(first[0], want) and torch.equal(model.generate(**call), want)  # free again
