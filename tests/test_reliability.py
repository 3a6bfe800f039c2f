"""Reliability around the happy path: stale prefix caches after a weight change, right-padded batches, results a
caller waits for, and a strategy lent per call (see also ``test_threads.py``)."""

from __future__ import annotations

import copy
import gc
import random
import threading

import pytest
import torch
from helpers import PAD, VOCAB, random_batch, tiny_model

import hf_accel
from hf_accel import Engine, PagedCache, PagedConfig, SpeculativeConfig
from hf_accel.core.errors import IncompatibleOptionsError
from hf_accel.core.fingerprint import weights_fingerprint

KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD)
PREFIXED = PagedConfig(num_blocks=64, block_size=4, prefix_cache=True)


def _shared_prefix_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = random_batch(2, lengths=[14, 14], seed=seed)
    ids[1, :10] = ids[0, :10]  # a common prefix: the second call adopts published blocks
    return ids, mask


def _edits():
    def no_grad_mul(model):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.25)

    def data_mul(model):  # bypasses the version counter: caught by the sampled values
        for p in model.parameters():
            p.data.mul_(1.25)

    def load(model):
        model.load_state_dict(tiny_model("llama", seed=9).state_dict())

    return {"no_grad_mul": no_grad_mul, "data_mul": data_mul, "load_state_dict": load}


def test_weights_fingerprint_sees_every_kind_of_update():
    model = tiny_model("llama")
    for name, edit in _edits().items():
        before = weights_fingerprint(model)
        assert weights_fingerprint(model) == before
        edit(model)
        assert weights_fingerprint(model) != before, name


@pytest.mark.parametrize("edit", list(_edits()))
def test_prefix_cache_is_dropped_when_the_weights_change_while_patched(edit):
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = _shared_prefix_batch()
    model.generate(input_ids=ids, attention_mask=mask, paged=PREFIXED, **KW)  # publishes the prompts' blocks
    _edits()[edit](model)
    out = model.generate(input_ids=ids, attention_mask=mask, paged=PREFIXED, **KW)
    fresh = tiny_model("llama")
    _edits()[edit](fresh)
    assert torch.equal(out, fresh.generate(input_ids=ids, attention_mask=mask, **KW))
    ((_, pool),) = model.__dict__["_hf_accel_state"].extras["paged_caches"].values()  # (layout, pool)
    (cache,) = pool.idle()
    assert cache.stats()["prefix_drops"] == 1 and cache.stats()["prefix_hit_tokens"] == 0


def test_a_user_cache_reused_across_unpatch_load_and_repatch_drops_its_prefixes():
    model = hf_accel.patch_model(tiny_model("llama"))
    cache = PagedCache.from_config(model, PREFIXED)
    ids, mask = _shared_prefix_batch()
    model.generate(input_ids=ids, attention_mask=mask, paged=cache, **KW)
    hf_accel.unpatch_model(model)
    model.load_state_dict(tiny_model("llama", seed=9).state_dict())
    hf_accel.patch_model(model)
    out = model.generate(input_ids=ids, attention_mask=mask, paged=cache, **KW)
    assert torch.equal(out, tiny_model("llama", seed=9).generate(input_ids=ids, attention_mask=mask, **KW))
    assert cache.stats()["prefix_drops"] == 1
    again = model.generate(input_ids=ids, attention_mask=mask, paged=cache, **KW)  # same weights: reused
    assert torch.equal(again, out) and cache.stats()["prefix_hit_tokens"] > 0 and cache.stats()["prefix_drops"] == 1


def test_engine_drops_prefixes_computed_with_old_weights():
    model = hf_accel.patch_model(tiny_model("llama"))
    prompt = random_batch(1, lengths=[13], seed=3)[0][0].tolist()
    engine = Engine(model, max_batch_tokens=32, max_running=2, paged=PREFIXED)
    engine.generate_many([prompt], max_new_tokens=6, eos_token_id=None)
    model.load_state_dict(tiny_model("llama", seed=9).state_dict())
    (second,) = engine.generate_many([prompt], max_new_tokens=6, eos_token_id=None)
    expected = tiny_model("llama", seed=9).generate(torch.tensor([prompt]), max_new_tokens=6, eos_token_id=None)
    assert torch.equal(second, expected[0]) and engine.cache.stats()["prefix_drops"] == 1


def _right_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = random_batch(3, lengths=[4, 9, 6], seed=5)
    rids, rmask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for r in range(3):
        n = int(mask[r].sum())
        rids[r, :n], rmask[r, :n] = ids[r, -n:], 1
    return rids, rmask


SPECULATIVE = {
    "prompt_lookup": lambda: {"prompt_lookup": True},
    "draft_model": lambda: {"draft_model": tiny_model("qwen2", seed=1)},
    "self": lambda: {"speculative": SpeculativeConfig(strategy="self")},
    "paged": lambda: {"paged": True},
    "lookup_paged": lambda: {"prompt_lookup": True, "paged": True},
}


@pytest.mark.parametrize("feature", list(SPECULATIVE))
def test_right_padding_and_mismatched_masks_get_a_typed_error(feature):
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = _right_padded()
    with pytest.raises(IncompatibleOptionsError, match=r"padding after a token.*padding_side = 'left'"):
        model.generate(input_ids=ids, attention_mask=mask, **SPECULATIVE[feature](), **KW)
    holes = torch.ones_like(mask)
    holes[1, 3] = 0
    with pytest.raises(IncompatibleOptionsError, match="padding after a token"):
        model.generate(input_ids=ids, attention_mask=holes, **SPECULATIVE[feature](), **KW)
    with pytest.raises(IncompatibleOptionsError, match=r"attention_mask \(3, 8\) does not match input_ids \(3, 9\)"):
        model.generate(input_ids=ids, attention_mask=mask[:, 1:], **SPECULATIVE[feature](), **KW)


@pytest.mark.parametrize("feature", ["plain", "native", "int8"])
def test_right_padding_without_speculation_matches_the_unpatched_model(feature):
    plain = tiny_model("llama", initializer_range=0.02)
    model = hf_accel.patch_model(
        tiny_model("llama", initializer_range=0.02), **({} if feature == "plain" else {feature: True})
    )
    ids, mask = _right_padded()
    out = model.generate(input_ids=ids, attention_mask=mask, **KW)
    if feature == "int8":  # lossy: same shape and prompt, tokens may differ
        assert out.shape == (3, 17) and torch.equal(out[:, :9], ids)
    else:
        assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **KW))


@pytest.mark.parametrize("background", [False, True])
def test_generate_many_keeps_every_result_beyond_keep_finished(background):
    model = hf_accel.patch_model(tiny_model("llama"))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(9)]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, eos_token_id=None)[0] for p in prompts]
    engine = Engine(
        model, max_batch_tokens=32, max_running=3, paged=PagedConfig(num_blocks=48, block_size=4), keep_finished=2
    )
    if background:
        engine.start()
    try:
        outs = engine.generate_many(prompts, max_new_tokens=4, eos_token_id=None)
    finally:
        engine.stop(timeout=60)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs, strict=True))
    assert len(engine._ledger.requests) == 2  # collected: the oldest are forgotten again


def test_generate_many_checks_every_prompt_before_queueing_any():
    model = hf_accel.patch_model(tiny_model("llama"))
    engine = Engine(model, max_batch_tokens=32, max_running=3, paged=PagedConfig(num_blocks=48, block_size=4))
    with pytest.raises(IncompatibleOptionsError, match="the prompt is empty"):
        engine.generate_many([[5, 6, 7], []], max_new_tokens=4)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("feature", list(SPECULATIVE))
def test_stop_strings_work_with_every_speculative_path(default_model, feature):
    tokenizer = default_model[1]  # its first 256 ids are single characters: the tiny model's text decodes
    plain = tiny_model("llama")
    model = hf_accel.patch_model(tiny_model("llama"))
    ids = torch.tensor([[40, 41, 42, 43, 40, 41, 42]])
    free = plain.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    texts = [tokenizer.decode([t]) for t in free[0, 9:-1].tolist()]  # from the 3rd new token on
    stop = next(
        t for t in texts if len(t) == 1 and t.isascii() and t.isprintable() and not t.isspace()
    )  # it stops there
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
    expected = plain.generate(ids, **kwargs)
    assert expected.shape[1] < free.shape[1]
    assert torch.equal(model.generate(ids, **SPECULATIVE[feature](), **kwargs), expected)
    kwargs.pop("tokenizer")
    with pytest.raises(IncompatibleOptionsError if feature != "paged" else ValueError, match="tokenizer"):
        model.generate(ids, **SPECULATIVE[feature](), **kwargs)


def test_paged_refuses_outputs_it_cannot_return_and_a_configured_cache_implementation():
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = random_batch(2, [5, 7], seed=2)
    for flag in ("output_attentions", "output_hidden_states"):
        with pytest.raises(IncompatibleOptionsError, match=f"does not return {flag.removeprefix('output_')}"):
            model.generate(input_ids=ids, attention_mask=mask, paged=True, return_dict_in_generate=True,
                           **{flag: True}, **KW)  # fmt: skip
    model.generation_config.cache_implementation = "static"
    with pytest.raises(IncompatibleOptionsError, match="generation config sets cache_implementation='static'"):
        model.generate(input_ids=ids, attention_mask=mask, paged=True, **KW)
    out = model.generate(input_ids=ids, attention_mask=mask, paged=True, cache_implementation=None, **KW)
    model.generation_config.cache_implementation = None
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, **KW))


def test_paged_logits_of_rows_finished_on_eos_match_the_unpatched_model():
    plain = tiny_model("llama")
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = random_batch(3, [4, 9, 6], seed=11)
    free = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 1])  # row 0's second new token: it finishes early, the others go on
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=PAD, return_dict_in_generate=True,
                  output_logits=True, output_scores=True)  # fmt: skip
    want = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = model.generate(input_ids=ids, attention_mask=mask, paged=True, **kwargs)
    assert torch.equal(got.sequences, want.sequences) and len(got.logits) == len(want.logits) > 2
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_engine_stream_replays_for_every_consumer_and_never_blocks_on_a_finished_request():
    model = hf_accel.patch_model(tiny_model("llama"))
    prompt = [5, 6, 7, 8, 9]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 5:].tolist()
    engine = Engine(model, max_batch_tokens=32, max_running=2, paged=PagedConfig(num_blocks=32, block_size=4))
    rid = engine.add_request(prompt, max_new_tokens=6, eos_token_id=None)
    first = engine.stream(rid)
    assert [next(first), next(first)] == ref[:2]
    assert list(engine.stream(rid)) == ref  # a second consumer (caller-driven) sees every token
    assert list(first) == ref[2:] and list(engine.stream(rid)) == ref  # finished: replayed, no wait
    engine.start()
    try:
        rid = engine.add_request(prompt, max_new_tokens=6, eos_token_id=None)
        seen: list[list[int]] = []
        _threads = [
            threading.Thread(target=lambda: seen.append(list(engine.stream(rid, timeout=60)))) for _ in range(3)
        ]
        for t in _threads:
            t.start()
        for t in _threads:
            t.join(60)
        assert seen == [ref] * 3 and list(engine.stream(rid)) == ref  # default timeout=None: finished, no block
    finally:
        engine.stop(timeout=60)


def test_two_threads_streaming_without_start_take_turns_driving_the_engine():
    model = hf_accel.patch_model(tiny_model("llama"))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    refs = [model.generate(torch.tensor([p]), **kw)[0, len(p) :].tolist() for p in prompts]
    engine = Engine(model, max_batch_tokens=32, max_running=2, paged=PagedConfig(num_blocks=32, block_size=4))
    ids = [engine.add_request(p, max_new_tokens=8, eos_token_id=None) for p in prompts]
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, list(engine.stream(ids[i])))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == {0: refs[0], 1: refs[1]}
    assert all(engine.result(i).finish_reason == "length" for i in ids)


def test_self_speculation_and_deepcopy_after_a_draft_model_call():
    plain = tiny_model("llama")
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = random_batch(2, [6, 8], seed=6)
    model.generate(input_ids=ids, attention_mask=mask, draft_model=tiny_model("qwen2", seed=1), **KW)
    out = model.generate(input_ids=ids, attention_mask=mask, speculative=SpeculativeConfig(strategy="self"), **KW)
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **KW))
    clone = copy.deepcopy(model)
    assert torch.equal(clone.generate(input_ids=ids, attention_mask=mask, **KW), out)


def test_kept_draft_strategies_follow_the_draft_object_not_its_id():
    model = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = random_batch(1, [6], seed=6)
    kept = model.__dict__["_hf_accel_state"].extras["speculative_strategies"]
    for seed in range(3):  # a new draft object each time (an old one's id may be reused once it is collected)
        draft = tiny_model("qwen2", seed=seed)
        model.generate(input_ids=ids, attention_mask=mask, draft_model=draft, **KW)
        (strategy,) = kept.entries["draft"].pool.idle()
        assert strategy.draft is draft and kept.entries["draft"].draft() is draft
        del draft, strategy
        gc.collect()


def test_unpatching_every_model_leaves_transformers_registries_as_they_were():
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    before = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
    a, b = hf_accel.patch_model(tiny_model("llama")), hf_accel.patch_model(tiny_model("qwen2"))
    assert "hf_accel_paged:sdpa" in AttentionInterface._global_mapping
    hf_accel.unpatch_model(a)
    ids, mask = random_batch(1, [5], seed=1)
    assert b.generate(input_ids=ids, attention_mask=mask, paged=True, **KW).shape == (1, 13)  # b still holds them
    hf_accel.unpatch_model(b)
    assert (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)) == before


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda m: hf_accel.patch_model(None), hf_accel.UnsupportedModelError, "NoneType is not a Transformers"),
        (
            lambda m: PagedCache(torch.nn.Linear(2, 2)),
            hf_accel.UnsupportedModelError,
            "PagedCache needs a Transformers",
        ),
        (lambda m: PagedCache(m, max_memory=1.5e6), IncompatibleOptionsError, "max_memory must be None, an int"),
        (lambda m: PagedCache(m, max_memory="1 parsec"), IncompatibleOptionsError, "a string such as '512MiB'"),
        (
            lambda m: PagedCache(m, num_blocks=4, prefix_cache="no"),
            IncompatibleOptionsError,
            "prefix_cache must be a bool",
        ),
        (lambda m: PagedCache(m, num_blocks=4).crop(3), IncompatibleOptionsError, "takes a negative count"),
        (
            lambda m: PagedCache(m, num_blocks=4).reorder_cache(torch.tensor([2])),
            IncompatibleOptionsError,
            "out of range",
        ),
        (lambda m: PagedCache(m, num_blocks=4).dense(0, torch.ones(1, 3)), IncompatibleOptionsError, "dense needs"),
        (
            lambda m: _engine(m).add_request([5, 6], max_new_tokens=0),
            IncompatibleOptionsError,
            "max_new_tokens must be",
        ),
        (lambda m: _engine(m).add_request([5, 6], stop_strings=["a"]), IncompatibleOptionsError, "need a tokenizer"),
        (
            lambda m: _engine(m).add_request([5, 6], temperature=-1.0, do_sample=True),
            IncompatibleOptionsError,
            "invalid generation options",
        ),
    ],
)
def test_small_misuses_get_typed_errors(make, error, message):
    with pytest.raises(error, match=message):
        make(hf_accel.patch_model(tiny_model("llama")))


def _engine(model):
    return Engine(model, max_batch_tokens=16, max_running=2, paged=PagedConfig(num_blocks=16, block_size=4))


def test_memory_sizes_as_strings():
    model = tiny_model("llama")
    assert PagedConfig(max_memory="1MiB").max_memory == 2**20 and PagedConfig(max_memory="2 GB").max_memory == 2 * 10**9
    assert PagedCache(model, max_memory="1MiB").num_blocks == PagedCache(model, max_memory=2**20).num_blocks


# ------------------------------------------------------------------ item 10: sliding windows with a draft model
@pytest.mark.parametrize("speculation", ["draft", "self", "lookup"])
def test_speculation_with_paged_goes_past_a_sliding_window(speculation):
    ids, mask = random_batch(2, [30, 21], seed=5)
    kw = {**KW, "max_new_tokens": 14}
    want = tiny_model("mistral", sliding_window=8).generate(input_ids=ids, attention_mask=mask, **kw)
    model = hf_accel.patch_model(tiny_model("mistral", sliding_window=8))
    extra = {
        "draft": {"draft_model": tiny_model("mistral", seed=1, sliding_window=8)},  # drafts get rejected: rollbacks
        "self": {"speculative": SpeculativeConfig(strategy="self")},
        "lookup": {"prompt_lookup": True},
    }[speculation]
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, paged=True, **extra, **kw), want)
    if speculation == "draft":
        assert hf_accel.last_stats(model).speculative["acceptance_rate"] < 1.0
        same = tiny_model("mistral", sliding_window=8)  # the target's weights: the draft's window is right too
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, paged=True, draft_model=same, **kw), want)
        assert hf_accel.last_stats(model).speculative["acceptance_rate"] == 1.0
    with pytest.raises(IncompatibleOptionsError, match=r"past the sliding window .* pass paged=True"):
        model.generate(input_ids=ids, attention_mask=mask, **extra, **kw)


@pytest.mark.parametrize("features", [{}, {"int8": True}])
@pytest.mark.parametrize("extra", [{"paged": True}, {"paged": True, "prompt_lookup": True}, {"prompt_lookup": True}])
def test_calls_inside_and_outside_inference_mode_share_the_kept_caches(features, extra):
    """A web server may run one request under ``torch.inference_mode()`` and the next under ``no_grad``: the paged
    pools kept on the model between calls are normal tensors, which both may write in place (an inference tensor
    refuses in-place updates outside inference mode)."""
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(copy.deepcopy(plain), **features)
    ids, mask = random_batch(2, seed=3)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **KW)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            got = patched.generate(input_ids=ids, attention_mask=mask, **KW, **extra)
        if not features:  # int8 is lossy: the same tokens are not promised
            assert torch.equal(got, expected), mode
    # a cache, and an Engine, built under inference mode serve outside it (the Engine's loop is another thread)
    with torch.inference_mode():
        cache = PagedCache(patched, num_blocks=16, block_size=4)
        engine = Engine(patched)
    patched.generate(input_ids=ids, attention_mask=mask, paged=cache, **KW)
    engine.start()
    try:
        rid = engine.add_request(ids[1].tolist(), max_new_tokens=8, do_sample=False, eos_token_id=None)
        assert len(list(engine.stream(rid, timeout=60))) == 8
    finally:
        engine.stop()
