"""bfloat16 / float16 Llama-family models through the native executor (``native=True``, opt-in; issue 32 item 2).

The executor reads the half-precision weights, norms and biases in place and keeps float32 activations and sums, so
for chunks of up to 16 rows it computes what the same weights widened to float32 compute (tier c, against that model,
at both initializer ranges); prompts of more rows round their activations to the half dtype for the half GEMM, as the
model does. It stays opt-in: against the half model's own forward, which rounds at every operator, greedy tokens can
part at near-ties.
"""

from __future__ import annotations

import pytest
import torch
from helpers import NO_AUTO_SPECULATION, assert_close, generate_in_threads, random_batch, tiny_model
from transformers import DynamicCache

import hf_accel
from hf_accel.native.apply import NativeForward
from hf_accel.native.layers import layers_choice
from hf_accel.patch import default_config

pytestmark = pytest.mark.skipif(layers_choice(set()) is None, reason="no native build on this CPU")
NO_EOS = dict(do_sample=False, eos_token_id=None)
HALVES = [torch.bfloat16, torch.float16]


def _pair(arch: str, dtype: torch.dtype, init: float = 0.2):
    """The half model through the executor, and its weights widened to float32 (the unpatched model's forward)."""
    overrides = dict(initializer_range=init)
    half = tiny_model(arch, dtype=dtype, **overrides)
    widened = tiny_model(arch, dtype=dtype, **overrides).to(torch.float32)
    patched = hf_accel.patch_model(half, native=True, **NO_AUTO_SPECULATION)
    return widened, patched


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3"])
@pytest.mark.parametrize("init", [0.2, 0.02])
def test_half_model_decodes_as_its_weights_in_float32(arch, dtype, init):
    widened, patched = _pair(arch, dtype, init)
    assert isinstance(patched.forward, NativeForward) and patched.forward.step.native.half == dtype
    for seed, lengths in enumerate([[7], [3, 8], [16]]):  # at most 16 rows per chunk: float32 activations throughout
        ids, mask = random_batch(len(lengths), lengths, seed=seed)
        expected = widened.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
        calls = patched.forward.calls
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
        assert torch.equal(got, expected), (arch, dtype, init, seed)
        assert patched.forward.calls - calls == 12


@pytest.mark.parametrize("dtype", HALVES)
def test_half_model_logits_and_a_wide_prompt(dtype):
    widened, patched = _pair("llama", dtype)
    ids, mask = random_batch(2, [5, 8], seed=4)
    with torch.no_grad():
        kw = dict(attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0), use_cache=True)
        expected = widened(input_ids=ids, cache=DynamicCache(config=widened.config), **kw).logits
        got = patched(input_ids=ids, cache=DynamicCache(config=patched.config), **kw).logits
        assert got.dtype == torch.float32  # float32 sums: the logits are not rounded to the half dtype
        real = mask.bool()
        assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5, name="narrow prompt logits")
        ids = torch.randint(3, 200, (1, 70), generator=torch.Generator().manual_seed(1))
        expected = tiny_model("llama", dtype=dtype)(input_ids=ids).logits.float()  # the half model's own forward
        got = patched(input_ids=ids, cache=DynamicCache(config=patched.config), use_cache=True).logits
    # 70 rows: activations rounded to the half dtype for the half GEMM, as the half model's forward rounds them (which
    # it does after every operator too): a few half-precision ulps apart (tests/test_half_linears.py's bounds)
    atol = 0.25 if dtype == torch.bfloat16 else 0.03
    assert_close(got, expected, atol=atol, rtol=0.02, name="wide prompt logits")
    out = patched.generate(input_ids=ids, max_new_tokens=4, **NO_EOS)
    assert out.shape == (1, 74)


def test_half_weights_edits_casts_and_unpatch(caplog):
    widened, patched = _pair("llama", torch.bfloat16)
    ids, mask = random_batch(1, [6], seed=2)
    with torch.no_grad():  # an in-place edit: the executor reads the parameter itself
        for model in (widened, patched):
            model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
            model.model.norm.weight.add_(0.5)
    expected = widened.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS), expected)
    patched.to(torch.float32)  # float32 weights: the float32 executor, the unpatched maths
    calls = patched.forward.calls
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS), expected)
    assert patched.forward.calls - calls == 6 and patched.forward.step.native.half is None
    hf_accel.unpatch_model(patched)
    assert "forward" not in vars(patched)


def test_half_models_keep_the_keyword_only_default_and_say_why():
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    config = default_config(model)
    assert config.native is None and config.speculative.auto is None
    patched = hf_accel.patch_model(model)
    assert "forward" not in vars(patched)
    chosen = hf_accel.patch_report(patched)["implementations"]["default"]["configuration"]
    off = hf_accel.patch_model(
        tiny_model("llama", dtype=torch.bfloat16), native=hf_accel.NativeConfig(half_precision=False)
    )
    why = hf_accel.patch_report(off)["implementations"]["native"]["decoder_layers"]["why"]
    assert why.endswith("torch.bfloat16 weights, and NativeConfig(half_precision=False)")
    assert chosen["uses"] == "keyword-only features"
    assert chosen["not"]["native executor + automatic self-speculation"].startswith("half-precision weights")


def test_speculative_verification_of_a_half_model_keeps_its_own_maths():
    """Without ``native=True`` a half model's speculative target is its own forward, not the float32-activation
    executor; with it, the executor it asked for."""
    from hf_accel.speculative.target import target_step

    assert target_step(tiny_model("llama", dtype=torch.bfloat16)) is None
    _, patched = _pair("llama", torch.bfloat16)
    assert target_step(patched).native.half == torch.bfloat16


def test_threads_share_a_half_models_executor():
    widened, patched = _pair("qwen2", torch.bfloat16)
    batches = [random_batch(1, [n], seed=n) for n in (5, 9, 12, 7)]
    expected = [widened.generate(input_ids=i, attention_mask=m, max_new_tokens=8, **NO_EOS) for i, m in batches]
    got = generate_in_threads(patched, batches, max_new_tokens=8, **NO_EOS)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
