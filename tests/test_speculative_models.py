"""Tier (c): speculative generate on tiny models of every architecture and on the real model."""

from __future__ import annotations

import contextlib
import copy
import itertools
import re

import pytest
import torch
from helpers import EOS, PAD, VOCAB, assert_close, build_or_skip, chat_batch, cpu_build, random_batch, tiny_model
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import hf_accel
from hf_accel import IncompatibleOptionsError
from hf_accel.native.growing import growing_cache, to_growing
from hf_accel.native.layers import PROMPT_MASK_CELLS, NativeLayers, layers_choice
from hf_accel.native.step import LeanStep
from hf_accel.speculative import DraftModel, PromptLookup, SelfSpeculative, Strategy
from hf_accel.speculative.ragged import RaggedCache
from hf_accel.speculative.strategies import Proposal


def _repetitive_batch(batch: int, seed: int = 0):
    """Left-padded prompts that repeat their own n-grams, so prompt lookup finds matches."""
    lengths = [12, 30, 21, 8][:batch]
    ids, mask = random_batch(batch, lengths, seed=seed)
    for row, n in enumerate(lengths):
        width = ids.shape[1]
        seg = ids[row, width - n : width - n + n // 2].clone()
        ids[row, width - len(seg) :] = seg
    return ids, mask


def _pair(arch: str, **overrides):
    return tiny_model(arch, **overrides), hf_accel.patch_model(tiny_model(arch, **overrides))


def _strategies(arch: str) -> dict[str, dict]:
    return {
        "prompt_lookup": {"prompt_lookup": True, "num_speculative_tokens": 4},
        "draft": {"draft_model": tiny_model(arch, seed=7), "num_speculative_tokens": 3},  # unrelated weights
    }


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_to_plain_generate(arch, batch):
    plain, patched = _pair(arch)
    ids, mask = _repetitive_batch(batch, seed=batch)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    for name, extra in _strategies(arch).items():
        for paged in (False, True):
            got = patched.generate(input_ids=ids, attention_mask=mask, paged=paged, **kwargs, **extra)
            assert torch.equal(got, expected), (name, paged)


@pytest.mark.parametrize("weights", ["int8", torch.bfloat16])
def test_self_speculative_is_exact_and_accepts_most_drafts(weights):
    plain, patched = _pair("qwen2")
    ids, mask = _repetitive_batch(3)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs).sequences
    out = patched.generate(input_ids=ids, attention_mask=mask, speculative=SelfSpeculative(weights), **kwargs)
    assert torch.equal(out.sequences, expected)
    assert out.speculative["acceptance_rate"] > 0.5  # a cheaper copy of the same model mostly agrees


@pytest.mark.parametrize(("paged", "weights"), [(False, "int8"), (True, "int8"), (False, torch.bfloat16)])
def test_self_speculative_draft_starts_from_the_target_prompt_cache(paged, weights):
    """Same dtype: the draft copies the target's prompt cache (Transformers' cache) or gathers it from the paged
    pool into its padded layout, and never runs the prompt; a draft in another dtype runs the prompt itself."""
    plain, patched = _pair("llama")
    ids, mask = _repetitive_batch(3)  # left-padded rows of 12, 30 and 21 tokens
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    spec = SelfSpeculative(weights)
    patched.generate(input_ids=ids, attention_mask=mask, speculative=spec, paged=paged, **kwargs)  # builds the copy
    widths: list[int] = []
    hook = spec.draft.register_forward_pre_hook(
        lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = patched.generate(input_ids=ids, attention_mask=mask, speculative=spec, paged=paged, **kwargs)
    finally:
        hook.remove()
    assert torch.equal(out, expected)
    seeded = weights == "int8"
    # first draft forward: the first generated token (seeded), or its own prefill: every row's prompt and first
    # generated token, left-padded to the longest row (30 + 1)
    assert widths[0] == (1 if seeded else ids.shape[1] + 1)
    assert all(w <= ids.shape[1] for w in widths[1:])


@pytest.mark.parametrize(
    ("arch", "weights", "layers", "paged"),
    [
        ("llama", None, [0, 2], False),  # the target's own weights, half its layers
        ("llama", "int8", [3, 0, 1], True),  # unsorted on purpose: kept in the target's order
        ("gemma2", torch.bfloat16, [1, 2], False),  # sliding / global layer types follow their layers
    ],
)
def test_self_speculative_layer_subset_is_exact(arch, weights, layers, paged):
    plain, patched = _pair(arch, num_hidden_layers=4)
    ids, mask = _repetitive_batch(3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    spec = SelfSpeculative(weights, layers=layers)
    out = patched.generate(
        input_ids=ids, attention_mask=mask, speculative=spec, paged=paged, return_dict_in_generate=True, **kwargs
    )
    assert torch.equal(out.sequences, expected)
    assert out.speculative["proposed"] > 0
    keep = sorted(layers)
    draft_layers = spec.draft.model.layers
    assert len(draft_layers) == spec.draft.config.num_hidden_layers == len(keep)
    assert [layer.self_attn.layer_idx for layer in draft_layers] == list(range(len(keep)))
    assert len(patched.model.layers) == patched.config.num_hidden_layers == 4  # the target is untouched
    if getattr(patched.config, "layer_types", None) is not None:
        assert spec.draft.config.layer_types == [patched.config.layer_types[i] for i in keep]
    # the kept layers are copies of the target's: same weights (bf16 / int8 copies aside)
    if weights is None:
        for new, old in enumerate(keep):
            assert torch.equal(
                draft_layers[new].self_attn.q_proj.weight, patched.model.layers[old].self_attn.q_proj.weight
            )


def test_self_speculative_layer_subset_starts_from_the_kept_layers_of_the_prompt_cache():
    plain, patched = _pair("llama", num_hidden_layers=4)
    ids, mask = _repetitive_batch(3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    spec = SelfSpeculative(None, layers=[1, 3])
    patched.generate(input_ids=ids, attention_mask=mask, speculative=spec, **kwargs)  # builds the copy
    widths: list[int] = []
    cached: list[int] = []

    def record(module, args, kw):
        widths.append(kw["input_ids"].shape[1])
        cached.append(len(kw["cache"].layers))

    hook = spec.draft.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = patched.generate(input_ids=ids, attention_mask=mask, speculative=spec, **kwargs)
    finally:
        hook.remove()
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert widths[0] == 1  # seeded: the prompt is never run by the draft
    assert set(cached) == {2}  # the copied prompt cache holds only the kept layers' keys/values


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": []}, "SelfSpeculative.layers is empty: keep at least one decoder layer"),
        ({"layers": [0, 2, 0]}, r"SelfSpeculative.layers lists a layer twice: \[0, 2, 0\]"),
        ({"layers": [0, -1]}, "SelfSpeculative.layers must be non-negative integers, got -1"),
        ({"layers": "0,1"}, "SelfSpeculative.layers must be decoder-layer indices, got '0,1'"),
        ({"weights": None}, "SelfSpeculative needs something cheaper than the target"),
        ({"weights": "fp8"}, "SelfSpeculative.weights must be 'int8', a torch.dtype or None, got 'fp8'"),
    ],
)
def test_self_speculative_bad_options(kwargs, message):
    with pytest.raises(IncompatibleOptionsError, match=message):
        SelfSpeculative(**kwargs)


def test_self_speculative_layers_checked_against_the_model():
    _, patched = _pair("llama")  # 2 decoder layers
    ids, mask = random_batch(1, [6])
    with pytest.raises(
        IncompatibleOptionsError,
        match=r"SelfSpeculative.layers names layer 2, but the model has 2 decoder layers \(0..1\)",
    ):
        patched.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=2, speculative=SelfSpeculative(layers=[0, 2])
        )
    with pytest.raises(
        IncompatibleOptionsError, match="keeps every decoder layer: the draft would be the target itself"
    ):
        patched.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=2, speculative=SelfSpeculative(None, layers=[0, 1])
        )


def _lean_draft(arch: str, int8: bool | str, **overrides):
    if arch == "mistral":
        overrides.setdefault("sliding_window", None)
    model = tiny_model(arch, **overrides)
    if int8 == "fused":  # a float draft with hf_accel's fused gate/up MLP (a patched model)
        return hf_accel.patch_model(model)
    return SelfSpeculative.build(hf_accel.patch_model(model), "int8") if int8 else model


_NATIVE = pytest.mark.skipif(layers_choice({16}) is None, reason="no native kernel on this CPU")


def _with_overrides(case):
    """A ``(arch, int8, native)`` case (plain or ``pytest.param``) with its config overrides (default none)."""
    values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
    return pytest.param(*values, *([{}] if len(values) == 3 else []), marks=marks)


_LEAN_CASES = [
    ("llama", False, False),
    ("mistral", False, False),
    ("qwen2", False, False),
    ("qwen3", False, False),
    ("smollm3", False, False),  # a layer without a rotary embedding (NoPE)
    ("llama", True, False),
    pytest.param("llama", False, True, marks=_NATIVE),
    pytest.param("mistral", False, True, marks=_NATIVE),
    pytest.param("qwen2", False, True, marks=_NATIVE),  # q/k/v biases
    pytest.param("qwen3", False, True, marks=_NATIVE),  # per-head q/k norms
    pytest.param("smollm3", False, True, {"num_hidden_layers": 4}, marks=_NATIVE),  # NoPE layers 1 and 3: 4 runs
    pytest.param("smollm3", True, True, marks=_NATIVE),
    pytest.param("llama", True, True, marks=_NATIVE),  # int8 copy with a fused gate/up
    pytest.param("qwen3", "fused", True, marks=_NATIVE),  # float, fused gate/up
    pytest.param("qwen2", True, True, marks=_NATIVE),
    pytest.param("llama", True, True, {"head_dim": 12}, marks=_NATIVE),  # head size not a multiple of the lanes
    # the vectorised SiLU: an MLP width with a scalar tail, and gates up to ~7.5 either side (both sigmoid branches)
    pytest.param("llama", False, True, {"intermediate_size": 40, "initializer_range": 0.25}, marks=_NATIVE),
]


@pytest.mark.parametrize(("arch", "int8", "native", "overrides"), [_with_overrides(c) for c in _LEAN_CASES])
def test_lean_draft_step_matches_the_model_forward(arch, int8, native, overrides):
    """The draft's one-token step without Transformers' forward: same logits and the same cache contents, over a
    ragged layout with left padding and a hole. ``native``: every layer in one native call over a growing cache;
    else the layers' modules over a plain ``DynamicCache``."""
    model = _lean_draft(arch, int8, **overrides)
    step = LeanStep.build(model, native=native)
    assert step is not None
    assert (step.native is not None) == native
    if native:  # the int8 projections' own maths and float32 K/V (W8A16 and float16 K/V: their own tests below)
        step.native.w8a16, step.native.kv_dtype = False, torch.float32
    ids, mask = random_batch(3, [4, 9, 6], seed=5)
    with torch.no_grad():
        ragged = RaggedCache(model, DynamicCache(config=model.config), mask)
        ragged.feed(ids, prefix=True, last=1)
        ragged.feed(
            torch.tensor([[7, 8], [9, 10], [11, 12]]), torch.tensor([[True, False], [True, True], [False, True]])
        )
        seeded = copy.deepcopy(ragged.cache)
        lean = RaggedCache(model, to_growing(seeded) if native else seeded, ragged.mask.clone(), step)
        assert native == (step.native is not None and step.native.serves(lean.cache))
        chunks = [  # (tokens, valid): one-token steps, and catch-ups of 2-3 tokens with holes
            (torch.full((3, 1), 13), None),
            (torch.tensor([[14, 15], [16, 17], [18, 19]]), torch.tensor([[False, True], [True, True], [True, False]])),
            (torch.full((3, 1), 20), None),
            (
                torch.tensor([[21, 22, 23]] * 3),
                torch.tensor([[True, True, True], [False, True, True], [True, True, True]]),
            ),
        ]
        for ids_, valid in chunks:
            for last in (0, 1, 2):  # every column's logits, then the same chunk again for the last 1 or 2 only
                if last:  # (rolled back first)
                    ragged.rollback([int(x) for x in (valid if valid is not None else torch.ones_like(ids_)).sum(1)])
                    lean.rollback([int(x) for x in (valid if valid is not None else torch.ones_like(ids_)).sum(1)])
                expected = ragged.feed(ids_, valid, last=last)  # [B, C or last, V] the model's own forward
                got = lean.feed(ids_, valid, last=last)
                assert got.shape == expected.shape
                real = (valid if valid is not None else torch.ones_like(ids_, dtype=torch.bool))[:, -got.shape[1] :]
                # fp32 (int8 copies de-quantize to the same fp32 weights in both): only op order differs; holes'
                # logits are never read
                assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5, name=f"{arch} logits")
        for a, b in zip(lean.cache.layers, ragged.cache.layers, strict=True):
            assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5, name="keys")
            assert_close(a.values, b.values, atol=1e-5, rtol=1e-5, name="values")
        assert torch.equal(lean.mask, ragged.mask)


@_NATIVE
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3", "fused"])
@pytest.mark.parametrize(
    ("lengths", "hole"),
    [
        ([70, 66, 41], False),  # PyTorch's causal attention per row over its real columns
        ([70, 66, 41], True),  # a hole inside a prompt: one masked call
        ([9, 5, 7], False),  # narrow: the layers' own attention kernel
    ],
)
def test_native_prompt_matches_the_model_forward(arch, lengths, hole):
    """A float model's prompt through the native layers (a target's prefill): the last position's logits and every
    real column's K/V as the model's own forward leaves them, over left padding (a row padded by 29 columns, whose
    padding queries see nothing) and a hole; then a verification-sized chunk over both caches agrees too. An int8
    copy's prompt keeps the model's forward."""
    model = _lean_draft("qwen3" if arch == "fused" else arch, "fused" if arch == "fused" else False)
    step = LeanStep.build(model, kv_dtype=torch.float32)
    ids, mask = random_batch(3, lengths, seed=11)
    if hole:
        mask[0, 20] = 0
    with torch.no_grad():
        native = RaggedCache(model, growing_cache(model.config), mask, step)
        assert step.takes_prompt(native.cache, mask.numel() * mask.shape[1])
        plain = RaggedCache(model, DynamicCache(config=model.config), mask)
        got, expected = native.feed(ids, prefix=True, last=1), plain.feed(ids, prefix=True, last=1)  # [3, 1, V]
        assert_close(got, expected, atol=2e-5, rtol=1e-5, name=f"{arch} prompt logits")  # fp32: op order only
        real = mask.bool()
        for a, b in zip(native.cache.layers, plain.cache.layers, strict=True):
            assert a.keys.shape == b.keys.shape
            # [B, H_kv, T, D] at the real columns (padding columns are never read)
            assert_close(a.keys.transpose(1, 2)[real], b.keys.transpose(1, 2)[real], atol=1e-5, rtol=1e-5, name="keys")
            assert_close(a.values.transpose(1, 2)[real], b.values.transpose(1, 2)[real], atol=1e-5, rtol=1e-5, name="v")
            assert bool(torch.isfinite(a.keys).all() and torch.isfinite(a.values).all())
        chunk = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
        got, expected = native.feed(chunk), plain.feed(chunk)  # [3, 3, V]
        assert_close(got, expected, atol=2e-5, rtol=1e-5, name=f"{arch} chunk logits")
    draft = _lean_draft("llama", True)
    assert not LeanStep.build(draft).takes_prompt(growing_cache(draft.config), 1)  # int8 projections
    assert not step.takes_prompt(growing_cache(model.config), PROMPT_MASK_CELLS + 1)  # a mask too large


@_NATIVE
def test_native_prompt_of_a_float_draft_keeps_float16_keys_and_values():
    """A float draft's own prompt (float16 K/V by default) through the native layers: logits within float16's
    rounding of the model's forward, same argmax, and the cache holds float16 K/V."""
    model = _lean_draft("llama", False)
    step = LeanStep.build(model)
    assert step.native.kv_dtype == torch.float16
    ids, mask = random_batch(3, [70, 66, 41], seed=12)
    with torch.no_grad():
        native = RaggedCache(model, growing_cache(model.config), mask, step)
        assert step.takes_prompt(native.cache, mask.numel() * mask.shape[1])
        got = native.feed(ids, prefix=True, last=1)  # [3, 1, V]
        expected = RaggedCache(model, DynamicCache(config=model.config), mask).feed(ids, prefix=True, last=1)
    # float16 keeps 11 significant bits of every key and value
    assert_close(got, expected, atol=float(5e-3 * expected.abs().max()), rtol=0, name="float16 K/V prompt logits")
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert all(layer.keys.dtype == torch.float16 for layer in native.cache.layers)


def test_lean_draft_step_applies_only_where_it_knows_the_model():
    assert LeanStep.build(tiny_model("gemma")) is None  # (1 + w) norms, scaled embeddings
    assert LeanStep.build(tiny_model("phi3")) is None  # fused projections
    assert LeanStep.build(tiny_model("mistral", sliding_window=8)) is None  # sliding-window attention
    hooked = tiny_model("llama")
    hooked.model.layers[0].register_forward_hook(lambda m, a, out: out)
    assert LeanStep.build(hooked) is None  # hooks must see the model's own forward


@pytest.mark.skipif(layers_choice({16}, "avx2") is None, reason="no AVX2 build of the native layers here")
def test_native_lean_layers_avx2_build_matches_the_modules():
    """The AVX2 build (CPUs without AVX-512) against the module path: int8 and float drafts, ragged chunks."""
    avx2 = layers_choice({16}, "avx2")
    assert avx2.impl == "cpu/avx2"
    for model in (_lean_draft("qwen2", True), _lean_draft("qwen3", False)):
        native, modules = LeanStep.build(model), LeanStep.build(model, native=False)
        native.native.choice = avx2
        native.native.w8a16 = native.native.w8a8 = False  # what a build without VNNI gets
        native.native.kv_dtype = torch.float32  # the module path's K/V (float16 K/V: their own test)
        ids, mask = random_batch(2, [5, 3], seed=3)
        with torch.no_grad():
            plain = RaggedCache(model, DynamicCache(config=model.config), mask)
            plain.feed(ids, prefix=True, last=1)
            a = RaggedCache(model, to_growing(copy.deepcopy(plain.cache)), mask.clone(), native)
            b = RaggedCache(model, copy.deepcopy(plain.cache), mask.clone(), modules)
            for chunk, valid in (
                (torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[1, 1, 0], [1, 1, 1]])),
                (torch.full((2, 1), 11), None),
            ):
                valid = None if valid is None else valid.bool()
                got, expected = a.feed(chunk, valid), b.feed(chunk, valid)
                real = valid if valid is not None else torch.ones_like(chunk, dtype=torch.bool)
                assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5, name="avx2 logits")  # fp32 op order


@_NATIVE
def test_native_lean_layers_apply_only_where_they_know_the_layers():
    """Float32 ``nn.Linear`` / fused MLP / weight-only int8 layers run natively; anything else keeps the modules."""
    from torch import nn

    from hf_accel.quant import Int8Linear

    assert LeanStep.build(hf_accel.patch_model(tiny_model("llama"))).native is not None  # fused fp32 gate/up
    assert LeanStep.build(_lean_draft("llama", True)).native is not None
    w8a8 = _lean_draft("llama", True)
    attn = w8a8.model.layers[1].self_attn
    attn.q_proj = Int8Linear.from_module(nn.Linear(64, 64, bias=False), activations="int8")
    cases = {
        "w8a8 projection": w8a8,
        "float64 weights": tiny_model("llama", dtype=torch.float64),
        "gelu MLP": tiny_model("llama", hidden_act="gelu"),
    }
    odd_eps = tiny_model("llama")
    odd_eps.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-3
    cases["differing norm epsilons"] = odd_eps
    for name, model in cases.items():
        step = LeanStep.build(model)
        assert step is not None and step.native is None, name  # the lean step over the modules still applies


@pytest.mark.parametrize(
    ("arch", "runner"),
    [("llama", LeanStep), pytest.param("qwen2", NativeLayers, marks=_NATIVE)],
    ids=["lean", "native"],
)
def test_self_speculation_runs_its_draft_lean(monkeypatch, arch, runner):
    """The draft's one-token steps and catch-ups go through the lean step (and, where it applies, the native layers:
    its first argument is ``[B, C, ...]`` either way); greedy output stays identical."""
    plain, patched = _pair(arch)
    ids, mask = _repetitive_batch(3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    widths: list[int] = []
    original = runner.__call__

    def counted(self, first, *args, **kw):
        widths.append(first.shape[1])
        return original(self, first, *args, **kw)

    monkeypatch.setattr(runner, "__call__", counted)
    out = patched.generate(input_ids=ids, attention_mask=mask, speculative=SelfSpeculative("int8"), **kwargs)
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert 1 in widths and max(widths) > 1  # one-token steps and catch-ups


class _Garbage(Strategy):
    """Proposes random tokens: may only cost time, never change greedy output."""

    name = "garbage"

    def propose(self, sequences, budgets):
        gen = torch.Generator().manual_seed(sum(s.shape[0] for s in sequences))
        return [Proposal(torch.randint(0, 256, (b,), generator=gen)) for b in budgets]


def test_garbage_drafts_never_change_greedy_output():
    plain, patched = _pair("llama")
    ids, mask = random_batch(3, [5, 14, 9], seed=3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out = patched.generate(
        input_ids=ids, attention_mask=mask, speculative=_Garbage(num_tokens=5), return_dict_in_generate=True, **kwargs
    )
    assert torch.equal(out.sequences, expected)
    assert out.speculative["proposed"] > 0 and out.speculative["target_forwards"] >= 12


def test_logits_processors_eos_and_stopping_criteria_behave_as_plain(arch):
    plain, patched = _pair(arch)
    ids, mask = _repetitive_batch(3, seed=5)
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(probe[1, ids.shape[1] + 3])  # row 1 meets this token early: rows finish at different steps

    class StopAfter(StoppingCriteria):  # a user criterion: stop a row once it holds 10 generated tokens
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 10, dtype=torch.bool)

    kwargs = dict(
        max_new_tokens=14,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        repetition_penalty=1.3,
        min_new_tokens=2,
        stopping_criteria=StoppingCriteriaList([StopAfter()]),
    )
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    for extra in _strategies(arch).values():
        assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, **kwargs, **extra), expected)


def test_a_batch_whose_rows_a_criterion_finishes_without_an_eos_token():
    """Without an EOS token Transformers pads no finished row: a row a stopping criterion (or a stop string) finished
    goes on generating until every row has finished. Speculation stops computing such a row, so explicit speculation
    refuses the batch, the default patch decodes it as usual, and with an EOS token set both agree with the plain
    model."""
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"))  # the default patch: automatic speculation of greedy calls
    ids, mask = _repetitive_batch(3, seed=5)
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    stop = int(probe[1, ids.shape[1] + 3])  # row 1 meets it early: rows finish at different steps

    class StopAt(StoppingCriteria):  # a user's per-row criterion
        def __call__(self, input_ids, scores, **kw):
            return input_ids[:, -1] == stop

    kwargs = dict(
        max_new_tokens=12, do_sample=False, pad_token_id=PAD, stopping_criteria=StoppingCriteriaList([StopAt()])
    )
    expected = plain.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, **kwargs)
    assert int(expected[1, ids.shape[1] + 4]) != PAD  # row 1 went on after it finished
    got = patched.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, **kwargs)
    assert torch.equal(got, expected)
    with pytest.raises(IncompatibleOptionsError, match="without an EOS token Transformers' decoding goes on"):
        patched.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, prompt_lookup=True, **kwargs)
    one = patched.generate(
        input_ids=ids[1:2], attention_mask=mask[1:2], eos_token_id=None, prompt_lookup=True, **kwargs
    )
    assert torch.equal(one, plain.generate(input_ids=ids[1:2], attention_mask=mask[1:2], eos_token_id=None, **kwargs))
    expected = plain.generate(input_ids=ids, attention_mask=mask, eos_token_id=EOS, **kwargs)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, eos_token_id=EOS, **kwargs), expected)
    got = patched.generate(input_ids=ids, attention_mask=mask, eos_token_id=EOS, prompt_lookup=True, **kwargs)
    assert torch.equal(got, expected)


def test_streamer_receives_every_token_once():
    _, patched = _pair("llama")
    ids, _ = _repetitive_batch(1)
    seen: list[list[int]] = []

    class Collect:
        ended = False

        def put(self, value):
            seen.append(value.flatten().tolist())

        def end(self):
            Collect.ended = True

    out = patched.generate(input_ids=ids, max_new_tokens=10, do_sample=False, prompt_lookup=True, streamer=Collect())
    assert seen[0] == ids[0].tolist()  # the prompt, put by Transformers
    assert [t for chunk in seen[1:] for t in chunk] == out[0, ids.shape[1] :].tolist() and Collect.ended


def test_return_dict_scores_and_stats():
    plain, patched = _pair("mistral")
    ids, mask = _repetitive_batch(2)
    kwargs = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    expected = plain.generate(input_ids=ids, attention_mask=mask, output_scores=True, **kwargs)
    out = patched.generate(input_ids=ids, attention_mask=mask, output_scores=True, prompt_lookup=True, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 6
    for a, b in zip(out.scores, expected.scores, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    stats = out.speculative
    assert stats["strategy"] == "prompt_lookup" and stats["tokens"] == 12
    assert stats["target_forwards"] <= 6 and 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["tokens_per_forward"] == pytest.approx(12 / stats["row_forwards"])


def test_sampling_matches_the_target_distribution():
    """Joint distribution of the first two sampled tokens, speculative vs exact, chi-square."""
    target = hf_accel.patch_model(tiny_model("llama"))
    draft = tiny_model("llama", seed=3)  # a different model: rejections and resampling happen
    prompt = torch.tensor([[5, 9, 14, 5, 9]])
    n = 3000
    kwargs = dict(do_sample=True, top_k=3, temperature=1.0, max_new_tokens=2, eos_token_id=None)
    torch.manual_seed(0)
    out = target.generate(input_ids=prompt.repeat(n, 1), draft_model=draft, num_speculative_tokens=2, **kwargs)
    pairs = out[:, -2:]
    # exact joint distribution under top-k=3 sampling of the target
    with torch.no_grad():
        first = torch.topk(target(input_ids=prompt).logits[0, -1], 3)
        p1 = torch.zeros(256).scatter(0, first.indices, first.values.softmax(-1))
        ext = torch.cat([prompt.repeat(3, 1), first.indices[:, None]], 1)
        second = torch.topk(target(input_ids=ext).logits[:, -1], 3)
    expected, observed = [], []
    for i in range(3):
        for j in range(3):
            a, b = int(first.indices[i]), int(second.indices[i, j])
            expected.append(float(p1[a] * second.values[i].softmax(-1)[j]) * n)
            observed.append(int(((pairs[:, 0] == a) & (pairs[:, 1] == b)).sum()))
    assert sum(observed) == n  # nothing outside the top-k support
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    assert chi2 < 26.1, (chi2, observed, expected)  # 8 degrees of freedom, p = 0.001


def test_bad_input_is_a_clear_error():
    plain, patched = _pair("llama")
    ids, _ = _repetitive_batch(1)
    cases = [
        (dict(draft_model=tiny_model("llama", vocab_size=300)), "vocabulary has 300 tokens but the target's has 256"),
        (dict(prompt_lookup=True, num_beams=2), "cannot be combined with beam search (num_beams=2)"),
        (dict(prompt_lookup=True, num_speculative_tokens=0), "num_speculative_tokens must be an int >= 1, got 0"),
        (dict(prompt_lookup=True, draft_model=plain), "takes one of speculative=, prompt_lookup=, draft_model="),
        (dict(num_speculative_tokens=3), "num_speculative_tokens= needs draft_model=, prompt_lookup=True"),
        (dict(prompt_lookup=True, prompt_lookup_num_tokens=3), "replaces Transformers' assisted generation"),
        (dict(speculative="fast"), "takes a Strategy, a SpeculativeConfig or True, got str"),
        (dict(prompt_lookup=True, cache_implementation="static"), "pass cache_implementation=None to this call"),
        (dict(speculative=PromptLookup(), num_speculative_tokens=2), "does not apply to a Strategy instance"),
        (dict(prompt_lookup=True, guidance_scale=2.0), "cannot be combined with classifier-free guidance"),
    ]
    for extra, message in cases:
        with pytest.raises(IncompatibleOptionsError) as info:
            patched.generate(input_ids=ids, max_new_tokens=3, do_sample=False, **extra)
        assert message in str(info.value), (extra, str(info.value))
    with pytest.raises(IncompatibleOptionsError, match="the draft model is on meta but the target is on cpu"):
        patched.generate(input_ids=ids, max_new_tokens=3, draft_model=tiny_model("llama").to("meta"))


def test_sliding_window_beyond_the_window_needs_the_paged_cache():
    plain, patched = _pair("mistral", sliding_window=8)
    ids, mask = _repetitive_batch(2)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, prompt_lookup=True)
    with pytest.raises(IncompatibleOptionsError, match="past the sliding window"):
        patched.generate(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=patched.config), **kwargs)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, paged=True, **kwargs), expected)


def test_patch_config_picks_the_default_strategy():
    cfg = hf_accel.SpeculativeConfig(strategy="self", num_tokens=3)
    plain = tiny_model("qwen3")
    patched = hf_accel.patch_model(tiny_model("qwen3"), speculative=cfg)
    ids, mask = _repetitive_batch(2)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    out = patched.generate(input_ids=ids, attention_mask=mask, speculative=True, return_dict_in_generate=True, **kwargs)
    assert out.speculative["strategy"] == "self"
    assert torch.equal(out.sequences, plain.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert isinstance(DraftModel(plain).k.num_tokens, int)


def test_keyword_strategies_are_kept_across_calls():
    plain, patched = _pair("llama")
    draft = tiny_model("qwen2")
    ids, mask = _repetitive_batch(2)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    kept = patched.__dict__["_hf_accel_state"].extras["speculative_strategies"]

    def idle(kind):
        (only,) = kept.entries[kind].pool.idle()  # one strategy, given back after the call
        return only

    patched.generate(input_ids=ids, attention_mask=mask, prompt_lookup=True, **kwargs)
    lookup = idle("prompt_lookup")
    fitted = lookup._costs[patched]._w  # the step-cost fit of the first call (its decayed sample weight)
    assert fitted > 0
    out = patched.generate(input_ids=ids, attention_mask=mask, prompt_lookup=True, **kwargs)
    assert idle("prompt_lookup") is lookup and lookup._costs[patched]._w > fitted  # the same fit, refined
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **kwargs))
    patched.generate(input_ids=ids, attention_mask=mask, prompt_lookup=True, num_speculative_tokens=3, **kwargs)
    assert idle("prompt_lookup") is not lookup  # other options: a new strategy replaces the kept one
    patched.generate(input_ids=ids, attention_mask=mask, draft_model=draft, **kwargs)
    first = idle("draft")
    patched.generate(input_ids=ids, attention_mask=mask, draft_model=draft, **kwargs)
    assert idle("draft") is first and kept.entries["draft"].pool.made == 1
    patched.generate(input_ids=ids, attention_mask=mask, draft_model=tiny_model("qwen2"), **kwargs)
    assert idle("draft") is not first  # another draft model is another strategy


@pytest.mark.parametrize("strategy", ["prompt_lookup", "self"])
def test_real_model_speculative_greedy_identical(default_model, strategy):
    model, tokenizer = default_model
    passage = (
        "The library opens at nine and closes at six on weekdays. On Saturdays it opens at ten and closes at "
        "four. Members may borrow up to eight books for three weeks and renew them twice."
    )
    prompts = [
        f"Fix the punctuation of the following passage and write it out again in full:\n\n{passage}",
        "What is the capital of France?",
    ]
    inputs = chat_batch(tokenizer, prompts)
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    # fallback=False: the assertion on tokens per forward must not depend on this machine's timing
    chosen = PromptLookup(fallback=False) if strategy == "prompt_lookup" else SelfSpeculative("int8", fallback=False)
    extra = {"speculative": chosen}
    with torch.inference_mode():
        expected = model.generate(**inputs, **kwargs)
        hf_accel.patch_model(model)
        try:
            got = model.generate(**inputs, return_dict_in_generate=True, **kwargs, **extra)
        finally:
            hf_accel.unpatch_model(model)
    assert torch.equal(got.sequences, expected)
    assert got.speculative["tokens_per_forward"] > 1.3  # the copying row is mostly verified in chunks


def test_composite_uses_the_first_strategy_with_a_proposal():
    from hf_accel.speculative import Composite

    plain, patched = _pair("llama")
    ids, mask = _repetitive_batch(3, seed=2)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    strategy = Composite(PromptLookup(num_tokens=4), DraftModel(tiny_model("llama", seed=5), num_tokens=3))
    out = patched.generate(
        input_ids=ids, attention_mask=mask, speculative=strategy, return_dict_in_generate=True, **kwargs
    )
    assert torch.equal(out.sequences, expected)
    assert out.speculative["strategy"] == "prompt_lookup+draft"
    with pytest.raises(IncompatibleOptionsError, match="Composite takes two or more Strategy instances"):
        Composite(PromptLookup())


def test_composite_survives_policy_cuts_and_finishing_rows(monkeypatch):
    """The policy may skip or shorten speculation on any step while rows finish: strategies must stay in step."""
    from hf_accel.speculative import Composite
    from hf_accel.speculative.policy import SpeculationPolicy

    plain, patched = _pair("qwen2")
    ids, mask = _repetitive_batch(3, seed=4)
    kwargs = dict(max_new_tokens=14, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    calls = iter(range(10_000))
    # every third step forced plain, every other one cut to at most 2 drafts
    monkeypatch.setattr(SpeculationPolicy, "choose", lambda self, lengths, producing=None: [2, 0, 99][next(calls) % 3])
    strategy = Composite(PromptLookup(num_tokens=3), DraftModel(tiny_model("qwen2", seed=5), num_tokens=2))
    got = patched.generate(input_ids=ids, attention_mask=mask, speculative=strategy, **kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("paged", [False, True])
def test_finished_rows_leave_the_batch_once_half_of_it_has_finished(paged):
    """Rows that finish early feed holes until at least half the batch has finished; output stays exact."""
    plain, patched = _pair("llama")
    ids, mask = _repetitive_batch(4, seed=3)
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    eos = int(probe[0, ids.shape[1] + 2])  # row 0 finishes at its third token; the others later or never
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    sizes: list[int] = []
    hook = patched.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        got = patched.generate(input_ids=ids, attention_mask=mask, paged=paged, prompt_lookup=True, **kwargs)
    finally:
        hook.remove()
    assert torch.equal(got, expected)
    finished_at = [
        int((expected[r, ids.shape[1] :] == eos).nonzero()[0]) if (expected[r, ids.shape[1] :] == eos).any() else None
        for r in range(4)
    ]
    assert finished_at[0] == 2 and any(f is None or f > 2 for f in finished_at[1:])
    # the batch only ever shrinks to at most half of what it was (4 -> 2 -> 1), never to 3
    changes = [(a, b) for a, b in itertools.pairwise(sizes) if a != b]
    assert 3 not in sizes and all(b <= a // 2 for a, b in changes), sizes


def test_growing_cache_layer_behaves_like_dynamic_layer():
    """The draft's in-place cache: same keys/values as DynamicCache through updates, crops, batch selection,
    reset and a deep copy, with appends landing in one buffer while it has room."""
    from hf_accel.native.growing import growing_cache, to_growing

    config = tiny_model("llama").config
    plain, grown = DynamicCache(config=config), growing_cache(config)
    gen = torch.Generator().manual_seed(0)

    def step(width: int) -> None:
        k, v = torch.randn(3, 2, width, 16, generator=gen), torch.randn(3, 2, width, 16, generator=gen)
        for layer in range(2):
            expected = plain.update(k, v, layer)
            got = grown.update(k, v, layer)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    step(5)
    buffer = grown.layers[0]._buf_k.data_ptr()
    step(1)
    step(3)
    assert grown.layers[0]._buf_k.data_ptr() == buffer  # appended in place
    plain.crop(-2), grown.crop(-2)
    step(1)
    assert grown.layers[0]._buf_k.data_ptr() == buffer  # a crop is a view: still the same buffer
    index = torch.tensor([0, 2])
    plain.batch_select_indices(index), grown.batch_select_indices(index)
    k, v = torch.randn(2, 2, 200, 16, generator=gen), torch.randn(2, 2, 200, 16, generator=gen)
    for layer in range(2):  # after a selection (a copy) and past the capacity: a new buffer, same contents
        expected, got = plain.update(k, v, layer), grown.update(k, v, layer)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert grown.get_seq_length() == plain.get_seq_length() == 208
    layer = grown.layers[0]
    buf_k, buf_v, used = layer.reserve(2, 2, 3, 16, torch.float32, torch.device("cpu"))  # a native writer's path
    assert used == 208 and buf_k.shape[2] >= 211 and buf_k.is_contiguous() and buf_v.shape == buf_k.shape
    assert torch.equal(buf_k[:, :, :used], plain.layers[0].keys) and layer.get_seq_length() == 208  # not yet visible
    buf_k[:, :, used : used + 3], buf_v[:, :, used : used + 3] = 1.0, 2.0
    keys, values = layer.commit(used + 3)
    assert layer.get_seq_length() == 211 and keys.data_ptr() == buf_k.data_ptr()
    assert torch.equal(keys[:, :, :used], plain.layers[0].keys) and bool((values[:, :, used:] == 2.0).all())
    assert layer.reserve(2, 2, 1, 16, torch.float32, torch.device("cpu"))[2] == 211  # unchanged views: fast path
    layer.crop(-3)
    assert layer.reserve(2, 2, 1, 16, torch.float32, torch.device("cpu"))[2] == 208  # the crop's views are new
    half_k, _, used = layer.reserve(2, 2, 1, 16, torch.float16, torch.device("cpu"))  # another dtype: converted
    assert used == 208 and half_k.dtype == torch.float16 and torch.equal(half_k[:, :, :used], layer.keys.half())
    fresh = growing_cache(config).layers[0]  # reserving on an empty layer initialises it
    buf_k, _, used = fresh.reserve(1, 2, 4, 16, torch.float32, torch.device("cpu"))
    assert used == 0 and fresh.is_initialized and fresh.commit(4)[0].shape == (1, 2, 4, 16)
    copied = to_growing(copy.deepcopy(plain))  # a seeded draft: the target's cache converted
    assert type(copied.layers[0]) is type(grown.layers[0])
    assert torch.equal(copied.layers[1].keys, plain.layers[1].keys)
    grown.reset()
    assert grown.get_seq_length() == 0


def _draft_feeds(monkeypatch, draft) -> list[tuple[int, int]]:
    """Record ``(width, last)`` of every feed into ``draft``'s cache."""
    feeds: list[tuple[int, int]] = []
    original = RaggedCache.feed

    def counted(self, ids, valid=None, prefix=False, last=0, hidden=False):
        if self.model is draft:
            feeds.append((ids.shape[1], last))
        return original(self, ids, valid, prefix, last, hidden)

    monkeypatch.setattr(RaggedCache, "feed", counted)
    return feeds


class _Oracle:
    """A guesser that knows the greedy continuation ``reference`` but gets every ``wrong``-th token of a guess wrong
    (so guesses hold in part and the draft's cache rolls back the rest)."""

    def __init__(self, reference: torch.Tensor, wrong: int = 4) -> None:
        self.reference, self.wrong = reference, wrong

    def lookup(self, seq: torch.Tensor, k: int) -> Proposal:
        guess = self.reference[seq.shape[0] : seq.shape[0] + k].clone()
        guess[self.wrong - 1 :: self.wrong] = (guess[self.wrong - 1 :: self.wrong] + 1) % VOCAB
        return Proposal(guess)


@pytest.mark.parametrize("sampling", [False, True])
def test_draft_checks_lookup_guesses_in_one_forward(monkeypatch, sampling):
    """``lookup=True``: a draft forward also feeds a guess of the next tokens and the draft's tokens follow it while
    they agree: the same proposals (same counts; sampled: the same seeded samples) in fewer draft forwards, output
    identical to plain generate (greedy) or to drafting token by token (sampled, same seed)."""
    plain, patched = _pair("llama")
    ids, _ = _repetitive_batch(1)
    kwargs = dict(max_new_tokens=24, eos_token_id=None, return_dict_in_generate=True)
    kwargs.update(dict(do_sample=True, top_k=2) if sampling else dict(do_sample=False))
    greedy = plain.generate(input_ids=ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    draft = copy.deepcopy(plain)  # drafts what the target says
    feeds = _draft_feeds(monkeypatch, draft)
    runs = {}
    for lookup in (False, True):
        feeds.clear()
        torch.manual_seed(0)
        strategy = DraftModel(draft, num_tokens=6, lookup=lookup)
        strategy._guesser = _Oracle(greedy[0])  # random tiny models do not copy: guesses from the known answer
        out = patched.generate(input_ids=ids, speculative=strategy, **kwargs)
        runs[lookup] = (out, list(feeds))
    (off, off_feeds), (on, on_feeds) = runs[False], runs[True]
    assert torch.equal(on.sequences, off.sequences)
    if not sampling:
        assert torch.equal(on.sequences, greedy)
        assert len(on_feeds) < len(off_feeds)
    for key in ("proposed", "accepted", "target_forwards"):
        assert on.speculative[key] == off.speculative[key], key
    assert all(last <= 1 for _, last in off_feeds)  # token by token: last logits only
    assert any(last > 1 for _, last in on_feeds)  # guesses checked


def test_draft_guesses_only_for_a_single_row(monkeypatch):
    """A batch's rows draft in the same forwards, so guesses are only checked while one row drafts; output exact."""
    plain, patched = _pair("llama")
    ids, mask = _repetitive_batch(3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    draft = copy.deepcopy(plain)
    feeds = _draft_feeds(monkeypatch, draft)
    out = patched.generate(input_ids=ids, attention_mask=mask, speculative=DraftModel(draft), **kwargs)
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert all(last <= 1 for _, last in feeds)


def test_draft_lookup_option_is_checked():
    with pytest.raises(IncompatibleOptionsError, match=r"^DraftModel.lookup must be True or False, got 'yes'$"):
        DraftModel(tiny_model("llama"), lookup="yes")
    with pytest.raises(IncompatibleOptionsError, match=r"^SelfSpeculative.lookup must be True or False, got 1$"):
        SelfSpeculative("int8", lookup=1)
    assert repr(SelfSpeculative("int8", lookup=False)) == (
        "SelfSpeculative(weights='int8', num_tokens=6, adaptive=True, lookup=False)"
    )
    assert "lookup" not in repr(SelfSpeculative("int8"))


@contextlib.contextmanager
def _native_modes():
    """Records the int8 mode (``lean.WEIGHT_ONLY`` / ``W8A16`` / ``W8A8``) of every native layers call inside."""
    calls: list[int] = []
    original = NativeLayers.__call__

    def spy(self, *args):
        calls.append(args[-1])
        return original(self, *args)

    NativeLayers.__call__ = spy
    try:
        yield calls
    finally:
        NativeLayers.__call__ = original


@_NATIVE
def test_native_lean_layers_w8a8_chunk_matches_w8a8_modules():
    """A wide chunk (a guess check) runs the int8 projections and the head as W8A8 (every build: VNNI, or AVX2's
    integer dots): the same maths as the draft's modules switched to ``activations="int8"``; narrow chunks stay
    weight-only."""
    from hf_accel.native import layers as lean
    from hf_accel.quant import Int8Linear

    model = _lean_draft("llama", True)
    native = LeanStep.build(model)
    native.native.kv_dtype = torch.float32
    assert native.native.w8a8 and native.native.choice.impl == layers_choice({16}).impl
    w8a8 = copy.deepcopy(model)
    for parent in list(w8a8.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                setattr(parent, name, Int8Linear(child.quantized, child.bias, activations="int8"))
    modules = LeanStep.build(w8a8, native=False)
    ids, mask = random_batch(2, [5, 3], seed=4)
    with _native_modes() as calls, torch.no_grad():
        plain = RaggedCache(model, DynamicCache(config=model.config), mask)
        plain.feed(ids, prefix=True, last=1)
        a = RaggedCache(model, to_growing(copy.deepcopy(plain.cache)), mask.clone(), native)
        b = RaggedCache(w8a8, copy.deepcopy(plain.cache), mask.clone(), modules)
        width = lean.W8A8_MIN_WIDTH
        chunk = torch.arange(5, 5 + 2 * width).view(2, width)
        valid = torch.ones(2, width, dtype=torch.bool)
        valid[1, :2] = False  # a hole
        got, expected = a.feed(chunk, valid), b.feed(chunk, valid)  # [2, W, V]
    assert calls == [lean.W8A8]
    # W8A8 rounds activations to int8 steps, so float-order differences between the two paths can move a value
    # across a rounding boundary: compare at the scale of one quantization step of the logits
    scale = expected[valid].abs().max()
    assert_close(got[valid], expected[valid], atol=float(2e-2 * scale), rtol=0, name="w8a8 logits")
    assert (got[valid].argmax(-1) == expected[valid].argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("isa", ["widest", "avx2"])
@pytest.mark.parametrize(
    ("rows", "features", "outputs"), [(1, 32, 4), (2, 576, 7), (3, 64, 100), (4, 1536, 12), (9, 96, 33)]
)
def test_w8a16_kernel_matches_its_reference(isa, rows, features, outputs):
    """Each build's W8A16 linear against :func:`w8a16_reference` (exact integer dots) and against the float
    product with the de-quantized weights, within the activations' rounding (half a step of each group)."""
    from hf_accel.quant.core import dequantize, quantize, quantize_activations16, w8a16_reference

    module = build_or_skip(isa)
    gen = torch.Generator().manual_seed(rows * features + outputs)
    x = torch.randn(rows, features, generator=gen) * torch.linspace(0.05, 20.0, features)  # uneven groups
    if features == 32:
        x[0] = 0.0  # every group of the row is zero: scale 0
    qw = quantize(torch.randn(outputs, features, generator=gen))
    got = module.w8a16_linear(x, qw.qweight, qw.scale)  # [M, N]
    exact = w8a16_reference(x, qw)
    scale = float(exact.abs().max())
    assert_close(got, exact.float(), atol=2e-6 * scale, rtol=1e-6, name="w8a16 vs reference")  # fp32 lane sums
    _, xscale = quantize_activations16(x)  # [M, 16]
    group = (torch.arange(features) % 32) // 2
    half_step = xscale[:, group].double() / 2  # [M, K] largest rounding error of each activation
    bound = half_step @ (qw.qweight.double().abs() * qw.scale.double()).T  # [M, N]
    error = (got.double() - x.double() @ dequantize(qw).double().T).abs()
    assert (error <= bound + 2e-6 * scale).all()


@_NATIVE
@pytest.mark.parametrize("isa", ["widest", "avx2"])
@pytest.mark.parametrize(
    ("rows", "features", "outputs"), [(1, 64, 4), (3, 576, 7), (4, 1536, 12), (13, 96, 33), (32, 16, 5)]
)
def test_native_float_linear_matches_the_exact_product(isa, rows, features, outputs):
    """The native layers' float projection of narrow chunks (weight read in place, sums in vector lanes) against the
    float64 product: within float32's summation bound, for row counts with and without a remainder of the row
    tiles and output counts with and without one of the 4-row weight tiles."""
    module = build_or_skip(isa)
    gen = torch.Generator().manual_seed(rows * features + outputs)
    x = torch.randn(rows, features, generator=gen) * torch.linspace(0.05, 20.0, features)
    w = torch.randn(outputs, features, generator=gen)
    assert module.float_linear_fits(x, w)
    got = module.float_linear(x, w)  # [M, N]
    exact = x.double() @ w.double().T
    # sequential sums over K / lanes steps per lane, then the lanes' reduction: gamma_n of n = K / 8 + 4 additions
    # (8: AVX2's lanes, the longest chains) times sum |x_k w_k|, float32's unit roundoff 2**-24
    n = features // 8 + 4
    bound = n * 2.0**-24 / (1 - n * 2.0**-24) * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()


@_NATIVE
def test_native_float_linear_leaves_wide_or_odd_products_to_torch():
    """Past 32 rows (MKL's GEMM is as fast there), a width that is not a multiple of the lanes, a non-contiguous or
    non-float32 weight: the layers use ``at::linear`` (``float_linear_fits`` is false), and a direct call says why."""
    module = cpu_build()
    w = torch.randn(8, 64)
    assert module.float_linear_fits(torch.randn(32, 64), w)
    assert not module.float_linear_fits(torch.randn(33, 64), w)
    assert not module.float_linear_fits(torch.randn(2, 20), torch.randn(8, 20))
    assert not module.float_linear_fits(torch.randn(2, 64), torch.randn(64, 8).T)
    assert not module.float_linear_fits(torch.randn(2, 64), w.double())
    lanes = 16 if module.isa().startswith("avx512") else 8
    message = (
        f"float_linear: needs float32 x [M <= 32, K] and a contiguous float32 weight [N, K], K a multiple of {lanes}"
    )
    with pytest.raises(RuntimeError, match=re.escape(message)):
        module.float_linear(torch.randn(33, 64), w)


@pytest.mark.parametrize("isa", ["widest", "avx2"])
def test_w8a16_kernel_rejects_weights_it_does_not_take(isa):
    from hf_accel.quant.core import quantize

    module = build_or_skip(isa)
    grouped = quantize(torch.randn(8, 64), group_size=32)
    with pytest.raises(RuntimeError, match="w8a16: needs one scale per weight row and in_features a multiple of 32"):
        module.w8a16_linear(torch.randn(2, 64), grouped.qweight, grouped.scale)
    assert module.w8a16_fits(576, 1) and not module.w8a16_fits(48, 1) and not module.w8a16_fits(16384, 1)


@_NATIVE
def test_native_lean_steps_of_several_rows_run_w8a16():
    """Steps and catch-ups of two or more activation rows run the int8 projections and the head as W8A16 (one row
    stays weight-only): logits within the activations' rounding of the modules' weight-only maths, same argmax."""
    from hf_accel.native import layers as lean

    model = _lean_draft("llama", True)
    native, modules = LeanStep.build(model), LeanStep.build(model, native=False)
    native.native.kv_dtype = torch.float32
    assert native.native.w8a16
    ids, mask = random_batch(2, [5, 3], seed=6)
    with _native_modes() as calls, torch.no_grad():
        plain = RaggedCache(model, DynamicCache(config=model.config), mask)
        plain.feed(ids, prefix=True, last=1)
        a = RaggedCache(model, to_growing(copy.deepcopy(plain.cache)), mask.clone(), native)
        b = RaggedCache(model, copy.deepcopy(plain.cache), mask.clone(), modules)
        for chunk, valid in ((torch.full((2, 1), 9), None), (torch.tensor([[10, 11], [12, 13]]), None)):
            got, expected = a.feed(chunk, valid), b.feed(chunk, valid)  # [2, C, V]
            # int16 activations: each rounded by at most 2**-16 of its group's largest value
            assert_close(got, expected, atol=float(2e-4 * expected.abs().max()), rtol=0, name="w8a16 logits")
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
        single = RaggedCache(model, to_growing(copy.deepcopy(plain.cache)), mask.clone(), native)
        single.select([0])
        single.feed(torch.full((1, 1), 9))
    assert calls == [lean.W8A16, lean.W8A16, lean.WEIGHT_ONLY]


@_NATIVE
@pytest.mark.parametrize("isa", ["widest", "avx2"])
def test_native_lean_steps_keep_float16_keys_and_values(isa):
    """By default the native layers keep the draft's K/V in float16 (half the bytes a step streams): the cache holds
    the float32 K/V rounded to float16 (the prompt's converted once), logits stay within float16's rounding of the
    float32 path with the same argmax, and a module-path feed afterwards gets float32 K/V back."""
    model = _lean_draft("qwen2", False)
    native, reference = LeanStep.build(model), LeanStep.build(model)
    if isa == "avx2":
        avx2 = layers_choice({16}, "avx2")
        if avx2 is None:
            pytest.skip("no AVX2 build of the native layers here")
        native.native.choice = reference.native.choice = avx2
        native.native.w8a16 = native.native.w8a8 = reference.native.w8a16 = reference.native.w8a8 = False
    assert native.native.kv_dtype == torch.float16
    reference.native.kv_dtype = torch.float32
    ids, mask = random_batch(2, [5, 3], seed=7)
    with torch.no_grad():
        plain = RaggedCache(model, DynamicCache(config=model.config), mask)
        plain.feed(ids, prefix=True, last=1)
        a = RaggedCache(model, to_growing(copy.deepcopy(plain.cache)), mask.clone(), native)
        b = RaggedCache(model, to_growing(copy.deepcopy(plain.cache)), mask.clone(), reference)
        for chunk in (torch.full((2, 1), 9), torch.tensor([[10, 11], [12, 13]])):
            got, expected = a.feed(chunk), b.feed(chunk)  # [2, C, V]
            # float16 keeps 11 significant bits of every key and value
            assert_close(got, expected, atol=float(5e-3 * expected.abs().max()), rtol=0, name="float16 K/V logits")
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
        prompt = mask.shape[1]
        for mine, theirs in zip(a.cache.layers, b.cache.layers, strict=True):
            assert mine.keys.dtype == torch.float16 and theirs.keys.dtype == torch.float32
            # the prompt's K/V: converted once, exactly the float32 values rounded
            assert torch.equal(mine.keys[:, :, :prompt], theirs.keys[:, :, :prompt].half())
            assert torch.equal(mine.values[:, :, :prompt], theirs.values[:, :, :prompt].half())
            # the steps' K/V: computed through attention over float16 K/V in the layers below, then rounded
            for got_kv, want_kv in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                assert_close(got_kv.float(), want_kv, atol=float(1e-2 * want_kv.abs().max()), rtol=0, name="K/V")
        a.step = None  # the model's own forward: its float32 update converts the buffers back
        a.feed(torch.full((2, 1), 14))
    assert all(layer.keys.dtype == torch.float32 for layer in a.cache.layers)


def test_growing_layer_saturates_when_a_writer_narrows_the_dtype():
    from hf_accel.native.growing import GrowingLayer

    layer = GrowingLayer()
    keys = torch.tensor([1.0, -1e6, 1e6, 0.5]).view(1, 1, 4, 1)  # [B, H_kv, T, D]
    layer.update(keys, -keys)
    buf_k, buf_v, used = layer.reserve(1, 1, 1, 1, torch.float16, keys.device)
    assert used == 4 and buf_k.dtype == torch.float16
    assert buf_k[0, 0, :4, 0].tolist() == [1.0, -65504.0, 65504.0, 0.5]  # saturated, not inf
    assert buf_v[0, 0, :4, 0].tolist() == [-1.0, 65504.0, -65504.0, -0.5]
