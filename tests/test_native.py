"""The ``native`` feature: plain decoding through the native executor (tier c), its fallbacks and reports (tier a).

Greedy tokens are compared with the unpatched model at the test models' wide initializer range (0.2) and at
Transformers' default (0.02), where logits sit close together and a float-order difference could flip a tie.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import NO_AUTO_SPECULATION, assert_close, generate_in_threads, random_batch, tiny_model
from transformers import DynamicCache, StaticCache

import hf_accel
from hf_accel.native.apply import NativeForward
from hf_accel.native.layers import layers_choice

pytestmark = pytest.mark.skipif(layers_choice(set()) is None, reason="no native build on this CPU")
LEAN = ["llama", "mistral", "qwen2", "qwen3", "smollm3", "exaone"]  # smollm3: a layer without rotary embedding
NO_EOS = dict(do_sample=False, eos_token_id=None)


def _pair(arch: str, init: float = 0.2, **patch):
    overrides = dict(initializer_range=init)
    if arch == "mistral":
        overrides["sliding_window"] = None
    plain = tiny_model(arch, **overrides)
    patched = hf_accel.patch_model(tiny_model(arch, **overrides), **{"native": True, **NO_AUTO_SPECULATION, **patch})
    return plain, patched


@pytest.mark.parametrize("arch", LEAN)
@pytest.mark.parametrize("init", [0.2, 0.02])
@pytest.mark.parametrize("lengths", [[7], [3, 17, 9]])
def test_greedy_identical_to_the_unpatched_model(arch, init, lengths):
    plain, patched = _pair(arch, init)
    assert isinstance(patched.forward, NativeForward)
    for seed in range(3):
        ids, mask = random_batch(len(lengths), lengths, seed=seed)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, **NO_EOS)
        calls = patched.forward.calls
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, **NO_EOS)
        assert torch.equal(got, expected), (arch, init, seed)
        assert patched.forward.calls - calls == 24  # the prompt and every decode step ran natively


@pytest.mark.parametrize("arch", LEAN)
def test_prompt_and_step_logits_match_the_models_forward(arch):
    plain, patched = _pair(arch)
    ids, mask = random_batch(3, [5, 12, 1], seed=4)
    with torch.no_grad():
        ref_cache, nat_cache = DynamicCache(config=plain.config), DynamicCache(config=patched.config)
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        expected = plain(input_ids=ids, attention_mask=mask, position_ids=pos, cache=ref_cache, use_cache=True).logits
        got = patched(input_ids=ids, attention_mask=mask, position_ids=pos, cache=nat_cache, use_cache=True).logits
        real = mask.bool()
        assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5, name="prompt logits")  # fp32 op order
        nxt, mask = torch.tensor([[9], [10], [11]]), torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        pos = pos[:, -1:] + 1
        expected = plain(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=ref_cache, use_cache=True).logits
        got = patched(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=nat_cache, use_cache=True).logits
        assert_close(got, expected, atol=2e-5, rtol=1e-5, name="step logits")


def test_prompts_false_runs_only_the_decode_steps_natively():
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(
        tiny_model("llama"), native=hf_accel.NativeConfig(prompts=False), **NO_AUTO_SPECULATION
    )
    ids, mask = random_batch(2, [4, 8], seed=1)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS), expected)
    assert patched.forward.calls == 5  # the decode steps; the prompt ran the model's own forward


def test_other_caches_and_options_run_the_replaced_forward():
    plain, patched = _pair("llama")
    ids, mask = random_batch(2, [4, 8], seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, **NO_EOS)
    expected = plain.generate(**kwargs)
    assert torch.equal(patched.generate(**kwargs, cache_implementation="static"), expected)
    assert patched.forward.calls == 0
    out = patched.generate(**kwargs, output_hidden_states=True, return_dict_in_generate=True)
    assert out.hidden_states is not None and patched.forward.calls == 0  # an option the executor lacks
    static = StaticCache(config=patched.config, max_cache_len=32)
    with torch.no_grad():
        patched(input_ids=ids, attention_mask=mask, cache=static, use_cache=True)
    assert patched.forward.calls == 0


def test_report_unpatch_and_models_it_cannot_serve(caplog):
    _, patched = _pair("qwen3")
    report = hf_accel.patch_report(patched)
    assert report["implementations"]["native"]["decoder_layers"]["uses"].startswith("cpu/")
    assert report["changes"]["native"] == {"forward runs the native executor (dynamic cache)": 1}
    hf_accel.unpatch_model(patched)
    assert "forward" not in vars(patched)
    not_lean = "model_type 'gemma' is not one of llama, mistral, qwen2, qwen3, smollm3, exaone"
    cases = {
        "gemma": (tiny_model("gemma"), not_lean),
        "bf16": (
            tiny_model("gemma", dtype=torch.bfloat16),
            not_lean,
        ),
        "fp64": (
            tiny_model("llama", dtype=torch.float64),
            "layer 0: self_attn.q_proj is a float64 Linear (it takes float32 or int8 with a native kernel)",
        ),
    }
    for name, (model, why) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_accel.native.apply"):
            hf_accel.patch_model(model, native=True)
        assert "forward" not in vars(model), name
        report = hf_accel.patch_report(model)["implementations"]["native"]
        choice = report["decoder_layers"]
        assert choice["uses"] == "model forward" and choice["why"].endswith(why), name
        if name == "bf16":  # half-precision weights: the feature's decode linears instead, no warning
            assert report["half_linear"]["uses"].startswith("cpu/") and why not in caplog.text
        else:
            assert why in caplog.text


def test_weights_replaced_after_patching_are_followed():
    plain, patched = _pair("llama")
    ids, mask = random_batch(2, [4, 8], seed=5)
    with torch.no_grad():  # a new tensor for one weight (as load_state_dict(assign=True) or param.data = ... make)
        for model in (plain, patched):
            layer = model.model.layers[1].self_attn.o_proj
            layer.weight.data = layer.weight.data.flip(0).clone()
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **NO_EOS), expected)
    assert patched.forward.calls == 8  # rebuilt from the new weights, still native


def test_a_cast_model_runs_its_own_forward(caplog):
    """The default patch's executor (``NativeConfig(half_precision=False)``): a cast to bfloat16 hands the forward
    back to the model (``native=True`` follows the cast instead: tests/test_native_half.py)."""
    plain, patched = _pair("llama", fused_mlp=False, native=hf_accel.patch.default_config(tiny_model("llama")).native)
    assert not hf_accel.patch_report(patched)["features"]["native"]["half_precision"]
    for model in (plain, patched):
        model.to(torch.bfloat16)
    ids, mask = random_batch(1, [6], seed=6)
    with caplog.at_level(logging.WARNING, logger="hf_accel.native.apply"):
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, **NO_EOS)
    assert torch.equal(got, plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, **NO_EOS))
    assert patched.forward.calls == 0 and "the executor cannot serve it any more" in caplog.text


def test_threads_share_the_executor():
    plain, patched = _pair("qwen2")
    batches = [random_batch(2, [3 + i, 9], seed=10 + i) for i in range(4)]
    expected = [plain.generate(input_ids=i, attention_mask=m, max_new_tokens=12, **NO_EOS) for i, m in batches]
    results = generate_in_threads(patched, batches, repeats=3, max_new_tokens=12, **NO_EOS)
    assert all(torch.equal(results[i], expected[i]) for i in range(4))


def test_speculation_verifies_through_the_same_executor():
    from hf_accel.speculative import PromptLookup
    from hf_accel.speculative.target import target_step

    plain, patched = _pair("llama")
    assert target_step(patched) is patched.forward.step
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    expected = plain.generate(input_ids=ids, max_new_tokens=16, **NO_EOS)
    got = patched.generate(input_ids=ids, max_new_tokens=16, speculative=PromptLookup(num_tokens=4), **NO_EOS)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "smollm3"])
@pytest.mark.parametrize("init", [0.2, 0.02])
def test_paged_generate_runs_its_decode_steps_natively(arch, init):
    plain, patched = _pair(arch, init)
    for seed, lengths in enumerate(([6], [3, 17, 9])):
        ids, mask = random_batch(len(lengths), lengths, seed=20 + seed)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, **NO_EOS)
        expected = plain.generate(**kwargs)
        calls = patched.forward.calls
        assert torch.equal(patched.generate(**kwargs, paged=True), expected), (arch, init, lengths)
        assert patched.forward.calls - calls >= 19  # every decode step (a short prompt too)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "smollm3"])
def test_engine_decode_steps_run_natively(arch):
    plain, patched = _pair(arch)
    prompts = [[5, 6, 7, 8], list(range(10, 40)), [9, 9, 9, 9, 9, 9, 9, 9], [3, 4]]
    expected = [plain.generate(torch.tensor([p]), max_new_tokens=12, **NO_EOS)[0] for p in prompts]
    got = patched.generate_many(prompts, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert patched.forward.calls >= 10  # the steps where every request decodes (prompt steps: the model's forward)
    calls = patched.forward.calls
    got = patched.generate_many(prompts, max_new_tokens=12, do_sample=False, eos_token_id=None, prompt_lookup=True)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))  # drafts in the packed rows
    assert patched.forward.calls > calls


@pytest.mark.parametrize("init", [0.2, 0.02])
def test_paged_speculation_verifies_through_the_paged_executor(init):
    """Prompt lookup over the paged cache: the greedy verification's hidden states (the screened head's input) and
    the plain steps come from the executor's paged build; tokens identical to the unpatched model's."""
    from hf_accel.speculative import PromptLookup

    plain, patched = _pair("llama", init)
    ids, mask = random_batch(2, [12, 7], seed=31)
    ids[0, :] = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6])  # something to copy
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, **NO_EOS)
    expected = plain.generate(**kwargs)
    got = patched.generate(**kwargs, paged=True, speculative=PromptLookup(num_tokens=4))
    assert torch.equal(got, expected) and patched.forward.calls > 0


def test_with_compile_and_paged_each_call_takes_its_own_path():
    cfg = hf_accel.CompileConfig(backend="eager", fullgraph=True, prepack=False)  # packed weights: the executor's not
    plain, patched = _pair("llama", compile=cfg)
    ids, mask = random_batch(2, [4, 8], seed=7)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS)
    expected = plain.generate(**kwargs)
    assert torch.equal(patched.generate(**kwargs), expected) and patched.forward.calls == 6
    calls = patched.forward.calls
    assert torch.equal(patched.generate(**kwargs, paged=True), expected)
    assert patched.forward.calls - calls == 6  # the executor takes the short prompt and the paged decode steps
    assert patched.forward.inner.steps == 0


def test_a_deep_copy_of_a_native_model_runs_its_class_forward():
    import copy

    plain, patched = _pair("llama")
    clone = copy.deepcopy(patched)
    assert not isinstance(vars(clone)["forward"], NativeForward)
    ids, _ = random_batch(1, [5], seed=8)
    with torch.no_grad():
        assert_close(clone(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=1e-5, name="copy")
