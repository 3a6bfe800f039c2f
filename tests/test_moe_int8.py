"""int8 on mixture-of-experts models: the int8 feature swaps every MoE layer's experts for :class:`Int8Experts`
(exact state, unpatch, skip, reports), which computes what the float model holding its de-quantized weights computes
on every registered MoE architecture, eagerly and in the compiled step; and its checkpoints (``save_quantized``,
``from_pretrained(quantization_config=...)``, ``save_pretrained``) round-trip."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import EOS, MOE_ARCHS, assert_close, generate_in_threads, random_batch, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_accel
from hf_accel import CompileConfig, Int8Config
from hf_accel.core.errors import CheckpointError, IncompatibleOptionsError
from hf_accel.core.registry import ARCHITECTURES, experts_modules
from hf_accel.quant.experts import Int8Experts
from hf_accel.speculative import SelfSpeculative

NO_EOS = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _experts(model, arch="mixtral"):
    return experts_modules(model, ARCHITECTURES[arch])


def _dequantized_twin(arch: str, **config) -> torch.nn.Module:
    """The float model holding exactly the int8 model's weights (int8-patched, then unpatched)."""
    twin = hf_accel.patch_model(tiny_model(arch), int8=Int8Config(**config))
    return hf_accel.unpatch_model(twin)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_int8_experts_compute_the_float_model_on_their_dequantized_weights(arch):
    ids, mask = random_batch(3, [4, 11, 8], seed=3)
    model = hf_accel.patch_model(tiny_model(arch), int8=True)
    assert all(isinstance(m, Int8Experts) for m in _experts(model, arch)) and _experts(model, arch)
    twin = _dequantized_twin(arch)
    with torch.no_grad():
        got, want = model(input_ids=ids, attention_mask=mask).logits, twin(input_ids=ids, attention_mask=mask).logits
    assert_close(got, want, atol=2e-5, rtol=1e-4, name=f"{arch} int8 logits")  # fp32 sums in another order
    expected = twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS), expected)


def test_int8_swaps_experts_keeps_routers_reports_and_unpatches(caplog):
    model = tiny_model("hunyuan_v1_moe")
    float_experts = model.model.layers[0].mlp.experts
    originals = {k: v.clone() for k, v in float_experts.state_dict().items()}
    router = model.model.layers[0].mlp.gate.wg
    count = model.num_parameters()
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        hf_accel.patch_model(model, int8=True)
    assert "stay in float" not in caplog.text
    int8 = model.model.layers[0].mlp.experts
    assert isinstance(int8, Int8Experts) and int8.gate_up_proj.dtype == torch.int8
    assert int8.gate_up_proj_scale.shape == (*int8.gate_up_proj.shape[:2], 1) and int8.group_size is None
    assert float_experts.gate_up_proj.numel() == 0  # the float experts are released
    assert model.model.layers[0].mlp.gate.wg is router and type(router) is torch.nn.Linear
    assert model.num_parameters() == count  # int8 matrices count as the parameters they replaced
    report = hf_accel.patch_report(model)["implementations"]
    assert report["moe"]["experts"]["uses"] == f"hf_accel Int8Experts ({report['int8']['int8_experts_linear']['uses']})"
    hf_accel.unpatch_model(model)
    assert model.model.layers[0].mlp.experts is float_experts
    for name, value in float_experts.state_dict().items():  # de-quantized: within half a step of each row's scale
        step = value.abs().amax(dim=-1, keepdim=True) / 127
        assert bool(((value - originals[name]).abs() <= step / 2 + 1e-7).all())


def test_keep_original_unpatches_exactly_and_skip_modules_keeps_experts_in_float(caplog):
    model = tiny_model("qwen3_moe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hf_accel.unpatch_model(hf_accel.patch_model(model, int8=Int8Config(keep_original=True)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        hf_accel.patch_model(model, int8=Int8Config(skip_modules=("*.layers.1.mlp.experts",)))
    assert isinstance(model.model.layers[0].mlp.experts, Int8Experts)
    assert not isinstance(model.model.layers[1].mlp.experts, Int8Experts)
    assert "experts of 1 mixture-of-experts layers stay in float (skip_modules)" in caplog.text
    assert hf_accel.patch_report(model)["changes"]["int8"]["experts left in float (skip_modules)"] == 1


def test_group_sizes_and_w8a8_on_experts():
    grouped = hf_accel.patch_model(tiny_model("mixtral"), int8=Int8Config(group_size=32))
    assert _experts(grouped)[0].group_size == 32 and _experts(grouped)[0].down_proj_scale.shape[-1] == 4  # I = 128
    with pytest.raises(IncompatibleOptionsError, match=r"q_proj: group_size 48 does not divide .*skip_modules"):
        hf_accel.patch_model(tiny_model("mixtral"), int8=Int8Config(group_size=48))
    skip = ("*_proj", "lm_head")
    with pytest.raises(IncompatibleOptionsError, match=r"experts: group_size 48 does not divide .*skip_modules"):
        hf_accel.patch_model(tiny_model("mixtral"), int8=Int8Config(group_size=48, skip_modules=skip))
    w8a8 = hf_accel.patch_model(tiny_model("mixtral"), int8=Int8Config(activations="int8"))
    assert _experts(w8a8)[0].group_size is None  # weight-only experts, said so
    assert "experts weight-only (W8A8 covers the linears)" in hf_accel.patch_report(w8a8)["changes"]["int8"]


@pytest.mark.parametrize("arch", ["mixtral", "glm4_moe", "gpt_oss"])
def test_int8_experts_in_the_compiled_step_match_eager_int8(arch):
    torch._dynamo.reset()
    ids, mask = random_batch(2, [5, 9], seed=4)
    eager = hf_accel.patch_model(tiny_model(arch), int8=True)
    expected = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, paged=True, **NO_EOS)
    for config in (CompileConfig(backend="eager"), CompileConfig(backend="inductor", regional=True)):
        model = hf_accel.patch_model(tiny_model(arch), int8=True, compile=config)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, paged=True, **NO_EOS)
        assert torch.equal(got, expected), config


def test_self_speculative_draft_of_an_int8_target_shares_its_int8_experts():
    model = hf_accel.patch_model(tiny_model("glm4_moe", num_hidden_layers=3), int8=True)
    draft = SelfSpeculative.build(model, None, [0, 2])
    mine, theirs = draft.model.layers[1].mlp.experts, model.model.layers[2].mlp.experts
    assert isinstance(mine, Int8Experts) and mine.gate_up_proj is theirs.gate_up_proj
    ids, mask = random_batch(2, [5, 9], seed=6)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    spec = SelfSpeculative(weights=None, layers=[0, 2], num_tokens=3)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, speculative=spec, **NO_EOS)
    assert torch.equal(got, expected)


# per-expert w1 / w3 / w2 keys; gate / up / down keys; GPT-OSS's transposed 3-D weights and biases
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_quantize_while_loading_equals_patching_and_round_trips(tmp_path, arch):
    hf_accel.register_quantizer()
    try:
        tiny_model(arch).save_pretrained(tmp_path / "float")
        ids, mask = random_batch(2, [4, 7])
        want = hf_accel.patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "float"), int8=True)
        config = Int8Config(group_size=32)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=Int8Config())
        assert all(isinstance(m, Int8Experts) for m in _experts(loaded, arch))
        with torch.no_grad():
            logits = loaded(input_ids=ids, attention_mask=mask).logits
            assert torch.equal(logits, want(input_ids=ids, attention_mask=mask).logits)
        loaded.save_pretrained(tmp_path / "int8")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "int8")
        with torch.no_grad():
            assert torch.equal(reloaded(input_ids=ids, attention_mask=mask).logits, logits)
        patched = hf_accel.patch_model(reloaded)  # the lossless features on the loaded int8 model; the report says so
        experts = hf_accel.patch_report(patched)["implementations"]["moe"]["experts"]
        assert experts["uses"].startswith("hf_accel Int8Experts (") and experts["why"].startswith("loaded int8: ")
        grouped = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
        assert _experts(grouped, arch)[0].group_size == 32
    finally:
        hf_accel.unregister_quantizer()


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])  # gpt_oss: written back [E, in, out], with its biases
def test_save_pretrained_writes_the_dequantized_experts_plain_transformers_loads(tmp_path, arch):
    model = hf_accel.patch_model(tiny_model(arch), int8=True)
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids, mask = random_batch(2, [4, 7])
    with torch.no_grad():
        want = _dequantized_twin(arch)(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits, want)


def test_save_quantized_round_trips_biased_transposed_experts(tmp_path):
    """GPT-OSS's int8 experts: [E, out, in] int8, scales and the float biases, written and read back bitwise."""
    model = hf_accel.patch_model(tiny_model("gpt_oss"), int8=True)
    hf_accel.save_quantized(model, tmp_path)
    loaded = hf_accel.load_quantized(tmp_path)
    experts = _experts(loaded, "gpt_oss")[0]
    assert isinstance(experts, Int8Experts) and experts.transposed and experts.down_proj_bias.dtype == torch.float32
    ids, mask = random_batch(2, [4, 9])
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits, want)


def test_experts_of_a_quantized_checkpoint_stay_as_they_are_with_the_reason(caplog):
    """GPT-OSS's Hub experts are MXFP4 (packed uint8): int8 leaves them, and says to load them de-quantized."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    model = tiny_model("gpt_oss")
    for layer in model.model.layers:
        layer.mlp.experts = Mxfp4GptOssExperts(model.config)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        hf_accel.patch_model(model, int8=True)
    assert all(type(m) is Mxfp4GptOssExperts for m in _experts(model, "gpt_oss"))
    reason = "Mxfp4GptOssExperts.gate_up_proj holds torch.uint8, not float weights"
    assert any(reason in note for note in hf_accel.patch_report(model)["changes"]["int8"]) and reason in caplog.text
    assert "Mxfp4Config(dequantize=True)" in caplog.text


def test_an_int8_checkpoint_with_float_experts_still_loads_and_a_bad_one_is_refused(tmp_path):
    """Checkpoints written before the int8 feature quantized experts hold them in float: they load as saved."""
    model = hf_accel.patch_model(tiny_model("mixtral"), int8=True)
    hf_accel.save_quantized(model, tmp_path)
    path = tmp_path / "model.int8.safetensors"
    tensors = load_file(str(path))
    for experts in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        for proj in ("gate_up_proj", "down_proj"):
            q, scale = tensors[f"{experts}.{proj}"], tensors.pop(f"{experts}.{proj}_scale")
            tensors[f"{experts}.{proj}"] = q.float() * scale
    save_file(tensors, str(path), metadata={"format": "1"})
    loaded = hf_accel.load_quantized(tmp_path)
    assert not any(isinstance(m, Int8Experts) for m in loaded.modules())
    ids, mask = random_batch(2, [4, 7])
    with torch.no_grad():
        got, want = loaded(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    assert_close(got, want, atol=2e-5, rtol=1e-4)
    tensors["model.layers.0.mlp.experts.gate_up_proj_scale"] = torch.ones(4, 256, 1)  # a float one beside a scale
    save_file(tensors, str(path), metadata={"format": "1"})
    with pytest.raises(CheckpointError, match=r"experts.gate_up_proj' must be int8, got torch.float32"):
        hf_accel.load_quantized(tmp_path)


def test_int8_moe_in_threads_equals_one_at_a_time():
    model = hf_accel.patch_model(tiny_model("mixtral"), int8=True)
    batches = [random_batch(2, seed=s) for s in range(3)]
    expected = [model.generate(input_ids=i, attention_mask=m, max_new_tokens=8, **NO_EOS) for i, m in batches]
    got = generate_in_threads(model, batches, max_new_tokens=8, **NO_EOS)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_int8_moe_engine_equals_generate():
    model = hf_accel.patch_model(tiny_model("qwen3_moe"), int8=True)
    ids, mask = random_batch(2, [5, 8], seed=9)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=EOS)
    engine = hf_accel.Engine(model, max_batch_tokens=16, max_running=2)
    requests = [engine.add_request(ids[r, mask[r].bool()].tolist(), max_new_tokens=8, eos_token_id=EOS) for r in (0, 1)]
    outputs = engine.run_until_done()
    for row, request in enumerate(requests):
        got = outputs[request].tokens
        assert got == expected[row, ids.shape[1] :].tolist()[: len(got)]


def test_bfloat16_model_runs_the_experts_kernel_on_float32_copies_of_its_rows():
    ids, mask = random_batch(2, [4, 7], seed=2)
    model = hf_accel.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), int8=True)
    twin = hf_accel.unpatch_model(hf_accel.patch_model(tiny_model("mixtral", dtype=torch.bfloat16), int8=True))
    with torch.no_grad():
        got, want = model(input_ids=ids, attention_mask=mask).logits, twin(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16 and _experts(model)[0].gate_up_proj_scale.dtype == torch.float32
    # the twin rounds its products to bf16 where the kernel sums in float32: a relative difference of bf16's order
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.02


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_an_int8_draft_of_an_int8_model_is_refused_unless_it_cuts_layers(arch):
    """It would be the target itself: pure overhead, so an error that says what to do; cutting layers still drafts."""
    model = hf_accel.patch_model(tiny_model(arch), int8=True)
    ids, mask = random_batch(1, [6])
    with pytest.raises(IncompatibleOptionsError, match=r"int8 already: the draft would be the target itself"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, speculative=SelfSpeculative("int8"),
                       **NO_EOS)  # fmt: skip
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **NO_EOS)
    cut = SelfSpeculative("int8", layers=[0])
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, speculative=cut, **NO_EOS),
                       expected)  # fmt: skip
