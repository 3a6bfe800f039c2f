"""The int8-screened LM head of greedy verification: tier (a) core (bound, argmax, fallbacks) and tier (c) loop."""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, assert_close, build_or_skip, tiny_model
from test_speculative_models import _repetitive_batch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_accel
from hf_accel.kernels.ops import choose
from hf_accel.quant.core import QuantizedWeight, w8a16_reference
from hf_accel.speculative import PromptLookup, SelfSpeculative
from hf_accel.speculative.screen import HeadScreen
from hf_accel.speculative.target import head_screen

# the screen's W8A16 kernel has a native build on every x86 CPU hf_accel builds for (VNNI or AVX2 integer dots)
_DOTS = pytest.mark.skipif(
    not choose("w8a16_linear", "cpu", groups=1).native, reason="no native W8A16 kernel on this CPU"
)


def _reference_kernel(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W8A16 product as defined (exact integer dots in float64), rounded to float32 like the kernel's output."""
    return w8a16_reference(x, QuantizedWeight(qweight, scale, qweight.shape[1])).float()


def _head(vocab: int = 300, width: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=gen) * 0.2
    weight[7] = weight[5] + 1e-4  # a near-duplicate pair: their logits nearly tie on any input
    return weight


def _hidden(rows: int, width: int = 64, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=gen) * torch.linspace(0.1, 8.0, width)  # uneven features
    h[0, 3] = 60.0  # an outlier: coarse int16 steps for its group
    return h


def test_bound_holds_for_every_logit():
    """|float64 logit - screened approximation| <= a * residual + b * qnorm for every row and token, where the screen
    takes a, b from the row alone (the bound it prunes with)."""
    weight = _head()
    screen = HeadScreen.build(weight, None, _reference_kernel)
    h = _hidden(40)
    exact = h.double() @ weight.double().T  # [M, V]
    approx = _reference_kernel(h, screen.qweight, screen.scale).double()
    norm = h.double().norm(dim=1)
    e_norm = h.shape[1] ** 0.5 * h.abs().amax(1).double() / (2 * 32767)
    bound = norm[:, None] * screen.residual.double() + e_norm[:, None] * screen.qnorm.double()  # without slack
    assert ((exact - approx).abs() <= bound).all()
    # the stored norms are those of the de-quantized weight and its residual (rounded up by at most 1e-4)
    q = screen.qweight.double() * screen.scale.double()
    assert_close(screen.qnorm, q.norm(dim=1).float(), atol=0, rtol=2e-4, name="qnorm")
    assert (screen.qnorm.double() >= q.norm(dim=1) * (1 - 1e-6)).all()
    assert (screen.residual.double() >= (weight.double() - q).norm(dim=1) * (1 - 1e-6)).all()


@pytest.mark.parametrize("bias", [False, True])
def test_argmax_equals_the_float_head(bias):
    weight = _head(seed=2)
    b = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(3)) if bias else None
    screen = HeadScreen.build(weight, b, _reference_kernel)
    h = _hidden(200, seed=4)
    h[10] = 0.0  # every logit equals the bias (or 0: the lowest id wins, as torch.argmax)
    full = h @ weight.T + (b if bias else 0)
    assert torch.equal(screen.argmax(h), full.argmax(-1))


def test_argmax_of_near_ties_is_the_float_heads():
    """Rows built so that tokens 5 and 7 lead by far and differ by ~1e-4 (inside the int8 error): the screen keeps
    both and the float32 recomputation picks the same one as the full head."""
    weight = _head(seed=5)
    screen = HeadScreen.build(weight, None, _reference_kernel)
    gen = torch.Generator().manual_seed(6)
    h = weight[5][None] * 40 + torch.randn(64, weight.shape[1], generator=gen) * 0.05  # [64, E]
    full = h @ weight.T
    top2 = full.topk(2, dim=-1)
    assert set(top2.indices.flatten().tolist()) == {5, 7}
    assert (top2.values[:, 0] - top2.values[:, 1]).max() < 0.05  # closer than the int8 error bound
    assert torch.equal(screen.argmax(h), full.argmax(-1))


def test_non_finite_rows_and_empty_input():
    weight = _head()
    screen = HeadScreen.build(weight, None, _reference_kernel)
    h = _hidden(3)
    h[1, 0] = float("nan")
    h[2, 5] = float("inf")
    assert torch.equal(screen.argmax(h), (h @ weight.T).argmax(-1))  # the full head decides, NaN rules included
    assert screen.argmax(torch.zeros(0, 64)).shape == (0,)


def test_build_refuses_weights_it_cannot_bound():
    with pytest.raises(ValueError, match="HeadScreen needs a finite 2-D float32 weight"):
        HeadScreen.build(torch.randn(8, 64, dtype=torch.float64), None, _reference_kernel)
    bad = torch.randn(8, 64)
    bad[2, 2] = float("inf")
    with pytest.raises(ValueError, match="HeadScreen needs a finite 2-D float32 weight"):
        HeadScreen.build(bad, None, _reference_kernel)


@pytest.mark.parametrize("isa", ["widest", "avx2"])
def test_native_kernel_screen_matches_the_float_head(isa):
    weight = _head(vocab=1000, width=96, seed=8)
    module = build_or_skip(isa)
    screen = HeadScreen.build(weight, None, module.w8a16_linear)
    h = _hidden(300, width=96, seed=9)
    assert torch.equal(screen.argmax(h), (h @ weight.T).argmax(-1))


# ------------------------------------------------------------------------------------------- in the loop
def _spy(monkeypatch) -> list[int]:
    rows: list[int] = []
    original = HeadScreen.argmax

    def argmax(self, h):
        rows.append(h.shape[0])
        return original(self, h)

    monkeypatch.setattr(HeadScreen, "argmax", argmax)
    return rows


@_DOTS
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("paged", [False, True])
def test_greedy_speculation_verifies_through_the_screen(monkeypatch, arch, paged):
    """Greedy calls without processors verify every real chunk position (and the prompt's last) through the screen;
    the tokens equal plain generate of the unpatched model and those of the float head."""
    plain = tiny_model(arch)
    patched = hf_accel.patch_model(tiny_model(arch))
    ids, mask = _repetitive_batch(3)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs).sequences
    rows = _spy(monkeypatch)
    for strategy in (SelfSpeculative("int8"), PromptLookup(num_tokens=4)):
        rows.clear()
        out = patched.generate(input_ids=ids, attention_mask=mask, speculative=strategy, paged=paged, **kwargs)
        assert torch.equal(out.sequences, expected), strategy
        assert rows[0] == 3  # the prompt: one position per row
        assert sum(rows[1:]) == out.speculative["row_forwards"] - 3 + out.speculative["proposed"]  # real positions
        off = type(strategy)(**({"weights": "int8"} if isinstance(strategy, SelfSpeculative) else {"num_tokens": 4}))
        off.screen_head = False
        rows.clear()
        out = patched.generate(input_ids=ids, attention_mask=mask, speculative=off, paged=paged, **kwargs)
        assert torch.equal(out.sequences, expected) and rows == []


class _ScoreReader(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@_DOTS
@pytest.mark.parametrize(
    "extra",
    [
        {"output_scores": True},
        {"output_logits": True},
        {"repetition_penalty": 1.3},
        {"do_sample": True, "top_k": 5},
        {"stopping_criteria": StoppingCriteriaList([_ScoreReader()])},
    ],
    ids=["scores", "logits", "processor", "sampling", "criterion"],
)
def test_screen_stays_off_where_scores_are_needed(monkeypatch, extra):
    patched = hf_accel.patch_model(tiny_model("llama"))
    ids, mask = _repetitive_batch(2)
    rows = _spy(monkeypatch)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    if "stopping_criteria" in extra:  # a batch's criterion needs an EOS token (test_speculative_models says why)
        kwargs["eos_token_id"] = EOS
    out = patched.generate(input_ids=ids, attention_mask=mask, speculative=PromptLookup(), **{**kwargs, **extra})
    assert rows == []
    if extra.get("output_scores"):
        assert len(out.scores) == 8 and out.scores[0].shape == (2, 256)


@_DOTS
def test_head_screen_applies_where_it_can_and_follows_weight_changes():
    model = tiny_model("llama")
    first = head_screen(model)
    assert isinstance(first, HeadScreen) and head_screen(model) is first  # built once
    with torch.no_grad():
        model.lm_head.weight[3] += 1.0  # in place: a new version of the weight
    second = head_screen(model)
    assert second is not first and torch.equal(second.weight[3], model.lm_head.weight[3])
    assert head_screen(tiny_model("gemma2")) is None  # soft-capped logits are not lm_head(hidden)
    assert head_screen(tiny_model("llama", dtype=torch.bfloat16)) is None
    hooked = tiny_model("llama")
    hooked.lm_head.register_forward_hook(lambda m, a, out: out)
    assert head_screen(hooked) is None
    assert head_screen(tiny_model("llama", hidden_size=48, head_dim=12)) is None  # width not a multiple of 32


@_DOTS
def test_head_screen_of_an_inference_tensor_head():
    """A model built under ``torch.inference_mode()`` has inference-tensor weights, which keep no version counter:
    the screen is keyed on sampled values instead, and greedy speculation gives the unpatched model's tokens."""
    with torch.inference_mode():
        plain, base = tiny_model("llama"), tiny_model("llama")
    assert base.lm_head.weight.is_inference()
    first = head_screen(base)
    assert isinstance(first, HeadScreen) and head_screen(base) is first
    with torch.inference_mode():
        base.lm_head.weight.mul_(1.5)  # every value, the sampled ones included
    second = head_screen(base)
    assert second is not first and torch.equal(second.weight, base.lm_head.weight)
    with torch.inference_mode():
        plain.lm_head.weight.mul_(1.5)
    patched = hf_accel.patch_model(base)
    ids, mask = _repetitive_batch(3)
    greedy = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **greedy)
    got = patched.generate(input_ids=ids, attention_mask=mask, prompt_lookup=True, **greedy)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------ the target's verification chunks
def test_target_chunks_run_the_native_layers_with_float32_kv(monkeypatch):
    """Without a cache of the user's, the loop gives the target a growing cache and runs its verification chunks
    through the native layers with float32 K/V: hidden states within fp32 rounding of the decoder's own forward, the
    K/V stored float32, greedy tokens identical to the unpatched model's."""
    from hf_accel.native.growing import growing_cache
    from hf_accel.speculative import target
    from hf_accel.speculative.ragged import RaggedCache

    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"))
    step = target.target_step(patched)
    assert step is not None and step.native.kv_dtype == torch.float32
    ids, mask = _repetitive_batch(3)
    chunk = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    valid = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    with torch.no_grad():
        a = RaggedCache(patched, growing_cache(patched.config), mask, step)
        b = RaggedCache(patched, growing_cache(patched.config), mask)
        for r in (a, b):
            r.feed(ids, prefix=True, last=1, hidden=True)
        got, expected = a.feed(chunk, valid, hidden=True), b.feed(chunk, valid, hidden=True)  # [B, 3, E]
    assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5, name="hidden")  # op order only
    for layer in a.cache.layers:
        assert layer.keys.dtype == torch.float32 and layer.keys.shape[-2] == mask.shape[1] + 3

    fed: list[bool] = []
    original = RaggedCache.feed

    def feed(self, *args, **kwargs):
        if self.model is patched and not kwargs.get("prefix"):
            fed.append(self.step is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RaggedCache, "feed", feed)
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected_ids = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got_ids = patched.generate(input_ids=ids, attention_mask=mask, speculative=PromptLookup(num_tokens=4), **kwargs)
    assert torch.equal(got_ids, expected_ids) and fed and all(fed)
    assert target.target_step(tiny_model("gemma")) is None  # not a lean architecture
    assert target.target_step(tiny_model("llama", dtype=torch.bfloat16)) is None  # no native layers for bf16


def test_screen_and_native_target_chunks_stay_off_under_tensor_parallelism():
    """A model Transformers sharded (``_tp_size`` > 1; its weights are DTensor shards whose collectives live in the
    modules' forwards) keeps its own forward and head: no screen, no native target chunks, no lean draft step. The
    two-process run itself is tests/test_scaling.py::test_tensor_parallel_two_cpu_processes."""
    from hf_accel.core.dispatch import is_tensor_parallel
    from hf_accel.native.step import LeanStep
    from hf_accel.speculative import target

    model = tiny_model("llama")
    assert not is_tensor_parallel(model) and LeanStep.build(model) is not None
    model._tp_size = 2
    assert is_tensor_parallel(model)
    assert head_screen(model) is None and target.target_step(model) is None and LeanStep.build(model) is None


def test_the_loop_says_how_it_verified_and_why():
    """Which head verified and what ran the target's chunks are in the call's stats, with the reason for a fallback."""
    patched = hf_accel.patch_model(tiny_model("llama"))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kwargs = dict(max_new_tokens=6, return_dict_in_generate=True)
    out = patched.generate(ids, prompt_lookup=True, do_sample=False, **kwargs)
    if choose("w8a16_linear", "cpu", groups=1).native:
        assert out.speculative["head"] == "int8 screen"
    assert out.speculative["target"].startswith("native executor (cpu/")
    sampled = patched.generate(ids, prompt_lookup=True, do_sample=True, **kwargs)
    assert (
        sampled.speculative["head"] == "float head: the call samples, has logits processors, or returns scores / logits"
    )
    paged = patched.generate(ids, prompt_lookup=True, paged=True, do_sample=False, **kwargs)
    assert paged.speculative["target"] == "paged cache"
    gemma = hf_accel.patch_model(tiny_model("gemma"))
    out = gemma.generate(ids, prompt_lookup=True, do_sample=False, **kwargs)
    assert out.speculative["head"].startswith("float head: model_type 'gemma'")
    why = "model_type 'gemma' is not one of llama, mistral, qwen2, qwen3, smollm3, exaone"
    assert out.speculative["target"] == f"model forward: {why}"
