"""W8A8 models through the native executor: every chunk (prompts included) runs the integer-dot W8A8 kernel the
modules themselves run (AVX-512 VNNI, or AVX2 where the test pretends the CPU lacks AVX-512), so the executor computes
the model's own maths (tier c), and it says why where it cannot (tier a).

W8A8 rounds every activation to int8, so a float-order difference elsewhere (the executor's attention, norms) can move
one activation across a rounding boundary: on real models greedy tokens may then part (Transformers' own eager and
sdpa attention part the same way). The tiny test models here have no such ties (checked at both initializer ranges).
"""

from __future__ import annotations

import pytest
import torch
from helpers import NO_AUTO_SPECULATION, assert_close, random_batch, tiny_model
from transformers import DynamicCache

import hf_accel
from hf_accel.kernels.ops import native_builds
from hf_accel.native.apply import NativeForward
from hf_accel.native.layers import W8A8, NativeLayers
from hf_accel.native.step import LeanStep
from hf_accel.quant.linear import Int8Linear

BUILDS = [isa for isa, fn in native_builds("decoder_layers").items() if fn is not None]
needs_native = pytest.mark.skipif(not BUILDS, reason="no native build on this CPU")
#: the widest build, and the AVX2 build by pretending the CPU lacks AVX-512 (modules and native layers alike)
WIDEST_AND_AVX2 = [pytest.param((), id="widest"), pytest.param(("avx512vnni", "avx512"), id="avx2")]
W8A8_CONFIG = hf_accel.Int8Config(activations="int8")
NO_EOS = dict(do_sample=False, eos_token_id=None)


def _pair(arch: str, init: float = 0.2):
    """The same W8A8 model with and without the executor (``native=False``: the modules' own forward)."""
    plain = hf_accel.patch_model(tiny_model(arch, initializer_range=init), int8=W8A8_CONFIG, native=False)
    native = hf_accel.patch_model(tiny_model(arch, initializer_range=init), int8=W8A8_CONFIG, native=True,
                                  **NO_AUTO_SPECULATION)  # fmt: skip
    return plain, native


@needs_native
@pytest.mark.parametrize("lacks", WIDEST_AND_AVX2)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3"])
@pytest.mark.parametrize("init", [0.2, 0.02])
def test_w8a8_greedy_identical_to_the_modules_forward(pretend_cpu_lacks, lacks, arch, init):
    pretend_cpu_lacks(*lacks)
    build = "avx2" if lacks else BUILDS[0]
    if build not in BUILDS:
        pytest.skip(f"no {build} build on this CPU")
    plain, native = _pair(arch, init)
    assert isinstance(native.forward, NativeForward)
    assert native.forward.step.native.int8_activations
    assert hf_accel.patch_report(native)["implementations"]["native"]["decoder_layers"]["uses"] == f"cpu/{build}"
    assert plain.lm_head.kernel_path(torch.randn(1, 64)) == "w8a8"  # the modules' own integer dots, not emulated
    for seed in range(3):
        ids, mask = random_batch(3, [3, 11, 7], seed=seed)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **NO_EOS)
        calls = native.forward.calls
        got = native.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **NO_EOS)
        assert torch.equal(got, expected), (arch, init, seed)
        assert native.forward.calls - calls == 16  # the prompt (W8A8 too) and every decode step ran natively


@needs_native
def test_w8a8_prompt_and_step_logits_match_the_modules_forward():
    plain, native = _pair("llama")
    ids, mask = random_batch(2, [9, 4], seed=3)
    with torch.no_grad():
        caches = DynamicCache(config=plain.config), DynamicCache(config=native.config)
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        kw = dict(attention_mask=mask, position_ids=pos, use_cache=True)
        expected = plain(input_ids=ids, cache=caches[0], **kw).logits
        got = native(input_ids=ids, cache=caches[1], **kw).logits
        real = mask.bool()
        assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5, name="prompt logits")
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        kw = dict(attention_mask=mask, position_ids=pos[:, -1:] + 1, use_cache=True)
        nxt = torch.tensor([[5], [6]])
        expected = plain(input_ids=nxt, cache=caches[0], **kw).logits
        got = native(input_ids=nxt, cache=caches[1], **kw).logits
        assert_close(got, expected, atol=2e-5, rtol=1e-5, name="step logits")


@needs_native
def test_every_chunk_of_a_w8a8_model_runs_w8a8():
    _, native = _pair("llama")
    layers = native.forward.step.native
    assert all(layers.mode(rows, width) == W8A8 for rows, width in [(1, 1), (2, 1), (5, 5), (64, 64)])
    assert LeanStep.exact(native).native.mode(1, 1) == W8A8  # a target's exact step keeps the model's maths


def test_w8a8_in_every_build_but_not_mixed_with_weight_only():
    model = hf_accel.patch_model(tiny_model("llama"), int8=W8A8_CONFIG, native=False)
    step = LeanStep.build(model, native=False)
    for isa in BUILDS:  # every build has the integer-dot kernels
        layers, why = NativeLayers.inspect(step, isa=isa)
        assert layers is not None and why == "" and layers.int8_activations and layers.w8a8, isa
    attn = model.model.layers[1].self_attn
    attn.o_proj = Int8Linear(attn.o_proj.quantized, None, activations="float")  # one weight-only projection
    layers, why = NativeLayers.inspect(step)
    if BUILDS:
        assert layers is None
        assert why == "some int8 projections are W8A8 and others weight-only (one native call runs them alike)"
