"""Mixture-of-experts architectures: the registry's MoE layers and routers (exact state), and every feature
greedy-identical to the unpatched model on every registered MoE architecture (the per-architecture tests elsewhere
run ``MOE_MATRIX``, one architecture of each MoE form)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import EOS, MOE_ARCHS, MOE_MATRIX, assert_close, generate_in_threads, random_batch, tiny_config, tiny_model
from torch import nn

import hf_accel
from hf_accel import CompileConfig, Engine, PagedConfig
from hf_accel.core.registry import ARCHITECTURES, decoder_linears, experts_modules, get_attr_path, resolve
from hf_accel.fused import FusedGatedMLP
from hf_accel.quant import Int8Linear
from hf_accel.quant.experts import Int8Experts
from hf_accel.speculative import SelfSpeculative

#: the layers of the 2-layer tiny models whose MLP is a mixture of experts (the rest keep a dense first layer)
DENSE_FIRST = {"glm4_moe", "ernie4_5_moe", "exaone_moe", "laguna", "mellum", "hy_v3"}


def moe_layers(arch: str) -> tuple[int, ...]:
    return (1,) if arch in DENSE_FIRST else (0, 1)


def test_every_moe_architecture_is_listed_and_the_matrix_holds_each_form():
    assert set(MOE_MATRIX) <= set(MOE_ARCHS)
    assert {mt for mt, spec in ARCHITECTURES.items() if spec.experts is not None} == {
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe",
        "cohere2_moe", "exaone_moe", "phimoe", "granitemoe", "gpt_oss", "minimax_m2", "solar_open", "laguna", "mellum",
        "hy_v3", "granitemoeshared", "granitemoe_swa",
    }  # fmt: skip


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_resolve_finds_each_moe_layer_and_its_experts(arch):
    model = tiny_model(arch)
    parts = resolve(model)
    spec = ARCHITECTURES[arch]
    assert parts.moe_layers == moe_layers(arch)
    for layer in parts:
        if layer.index in parts.moe_layers:
            assert layer.experts is get_attr_path(layer.mlp, spec.experts)
            assert layer.experts.gate_up_proj.dim() == 3 and layer.experts.down_proj.dim() == 3
        else:  # a dense first layer: checked against the dense projection paths like any dense model's
            assert layer.experts is None and isinstance(get_attr_path(layer.mlp, spec.down_proj), nn.Linear)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routers_are_never_among_the_linears_features_swap(arch):
    model = tiny_model(arch)
    spec = ARCHITECTURES[arch]
    names = [name for name, _ in decoder_linears(model, spec)]
    routers = [f"{spec.layers}.{i}.{spec.mlp}.{spec.router}" for i in moe_layers(arch)]
    for router in routers:
        get_attr_path(model, router)  # the spec's router path exists on every MoE layer
        assert not [n for n in names if n == router or n.startswith(router + ".")]
    assert f"{spec.layers}.0.{spec.attention}.q_proj" in names and spec.lm_head in names
    if arch == "qwen2_moe":  # the shared expert's gate is not the router: it is quantized like any linear
        assert f"{spec.layers}.0.mlp.shared_expert_gate" in names


def test_a_malformed_experts_module_is_refused_by_name():
    model = tiny_model("mixtral")
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = nn.Parameter(experts.down_proj.detach()[0])  # [out, in]: not one weight per expert
    with pytest.raises(hf_accel.UnsupportedModelError, match=r"MixtralExperts.down_proj is not a 3-D"):
        hf_accel.patch_model(model)


def _generate(model, ids, mask, **kwargs) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kwargs)


#: patch_model keywords and generate keywords, each compared with the unpatched model's greedy tokens
FEATURES = {
    "default": ({}, {}),
    "paged": ({}, {"paged": True}),
    "prompt lookup + paged": ({}, {"prompt_lookup": True, "paged": True}),
    "self-speculation": ({}, {"speculative": SelfSpeculative(num_tokens=3)}),
    "compile + paged": ({"compile": CompileConfig(backend="eager")}, {"paged": True}),
}


#: the MoE types whose compiled step ``test_every_feature_...`` traces (eager backend), one per trait: plain experts,
#: dense layers with shared experts, a router read directly (``MOE_MATRIX``, whose per-architecture tests compile
#: too); a shared expert's gate; grouped top-k routing; q/k norms over all heads; per-layer query heads with a gated
#: output; attention sinks (with sliding layers). The other types share these code paths.
COMPILED_MOE = (*MOE_MATRIX, "qwen2_moe", "solar_open", "minimax_m2", "laguna", "gpt_oss", "granitemoe_swa")


def _short_window(arch: str) -> bool:
    """Whether the tiny model has sliding layers whose window is shorter than the tests' generations."""
    config = tiny_config(arch)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    return sliding and (getattr(config, "sliding_window", None) or 1 << 20) < 32


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_every_feature_greedy_identical_on_every_moe_architecture(arch):
    ids, mask = random_batch(3, [4, 11, 8], seed=3)
    reference = _generate(tiny_model(arch), ids, mask)
    for name, (patch_kwargs, call_kwargs) in FEATURES.items():
        if name == "compile + paged" and arch not in COMPILED_MOE:
            continue  # tracing the step takes ~5 s per type: the types with their own traits run it
        if name == "self-speculation" and _short_window(arch):
            call_kwargs = {**call_kwargs, "paged": True}  # Transformers' sliding layers cannot roll back past it
        model = hf_accel.patch_model(tiny_model(arch), **patch_kwargs)
        assert torch.equal(_generate(model, ids, mask, **call_kwargs), reference), f"{arch}: {name}"
    model = hf_accel.patch_model(tiny_model(arch))
    engine = Engine(model, max_batch_tokens=16, max_running=3, paged=PagedConfig(num_blocks=16, block_size=4))
    prompts = [ids[row, mask[row].bool()].tolist() for row in range(3)]
    requests = [engine.add_request(p, max_new_tokens=10, eos_token_id=EOS) for p in prompts]
    outputs = engine.run_until_done()
    for row, request in enumerate(requests):
        expected = reference[row, ids.shape[1] :].tolist()
        got = outputs[request].tokens
        assert got == expected[: len(got)] and (len(got) == 10 or got[-1] == EOS), f"{arch}: Engine row {row}"


@pytest.mark.parametrize("arch", MOE_MATRIX)
def test_greedy_identical_at_the_default_initializer_range(arch):
    """At 0.02 router scores and logits sit close together: a float-order difference would flip an expert choice."""
    ids, mask = random_batch(4, [3, 12, 7, 10], seed=11)
    reference = _generate(tiny_model(arch, initializer_range=0.02), ids, mask, max_length=None)
    for _, (patch_kwargs, call_kwargs) in FEATURES.items():
        model = hf_accel.patch_model(tiny_model(arch, initializer_range=0.02), **patch_kwargs)
        assert torch.equal(_generate(model, ids, mask, **call_kwargs), reference)


def test_patch_report_says_what_runs_the_experts():
    model = hf_accel.patch_model(tiny_model("glm4_moe", num_hidden_layers=3))
    choice = hf_accel.patch_report(model)["implementations"]["moe"]["experts"]
    assert choice["uses"].startswith("Transformers' 'grouped_mm' experts implementation")
    assert choice["why"].startswith("2 MoE layers in float: ")
    assert set(choice["not"]) == {"fused gated MLP", "hf_accel Int8Experts"}
    assert choice["not"]["hf_accel Int8Experts"].startswith("runs with int8=")
    ungated = tiny_model("mixtral")
    for layer in ungated.model.layers:
        layer.mlp.experts.has_gate = False
    report = hf_accel.patch_report(hf_accel.patch_model(ungated))["implementations"]["moe"]["experts"]
    assert report["not"]["hf_accel Int8Experts"].startswith("int8= leaves these experts in float: MixtralExperts")
    dense = hf_accel.patch_model(tiny_model("llama"))
    assert "moe" not in hf_accel.patch_report(dense)["implementations"]


def test_fused_mlp_fuses_dense_layers_and_says_it_left_each_mixture_of_experts():
    model = tiny_model("glm4_moe")
    moe_block = model.model.layers[1].mlp
    hf_accel.patch_model(model, fused_mlp=True)
    assert isinstance(model.model.layers[0].mlp, FusedGatedMLP)  # the dense first layer
    assert model.model.layers[1].mlp is moe_block
    notes = hf_accel.patch_report(model)["changes"]["fused_mlp"]
    assert notes["MLP left as is (a mixture of experts; Transformers' experts implementation runs it)"] == 1


@pytest.mark.parametrize("arch", ["qwen2_moe", "granitemoe"])  # a gated shared expert; the router under "router"
def test_int8_checkpoint_of_a_moe_model_round_trips(arch, tmp_path):
    model = hf_accel.patch_model(tiny_model(arch), int8=True)
    ids, mask = random_batch(2, [5, 9], seed=4)
    expected = _generate(model, ids, mask)
    hf_accel.save_quantized(model, tmp_path)
    loaded = hf_accel.load_quantized(tmp_path)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, Int8Linear)
    assert isinstance(experts_modules(loaded, ARCHITECTURES[arch])[0], Int8Experts)
    assert torch.equal(_generate(loaded, ids, mask), expected)


def test_unpatch_restores_a_moe_model_exactly():
    model = tiny_model("qwen2_moe")
    before = {name: value.clone() for name, value in model.state_dict().items()}
    modules = dict(model.named_modules())
    hf_accel.patch_model(model, compile=CompileConfig(backend="eager"), paged=True)
    _generate(model, *random_batch(2, [4, 6], seed=1), paged=True)
    hf_accel.unpatch_model(model)
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(model.get_submodule(name) is module for name, module in modules.items())
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())


def test_prompt_lookup_on_a_moe_model_in_threads():
    model = hf_accel.patch_model(tiny_model("mixtral"))
    batches = [random_batch(2, seed=s) for s in range(3)]
    expected = [_generate(tiny_model("mixtral"), ids, mask) for ids, mask in batches]
    got = generate_in_threads(model, batches, max_new_tokens=10, do_sample=False, prompt_lookup=True)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("weights", ["int8", None, torch.bfloat16])
def test_a_self_speculative_draft_never_copies_the_float_experts(weights):
    """The experts are most of a MoE model's bytes: a layer-cut draft shares the target's, an int8 draft builds int8
    experts of its own from them; a dtype draft converts a copy, and the target's stay as they were."""
    model = hf_accel.patch_model(tiny_model("glm4_moe", num_hidden_layers=3))  # layer 0 dense, 1 and 2 MoE
    spec = ARCHITECTURES["glm4_moe"]
    layers = [0, 2] if weights is None else None
    draft = SelfSpeculative.build(model, weights, layers)
    theirs = experts_modules(model, spec)
    mine = [layer.mlp.experts for layer in draft.model.layers if hasattr(layer.mlp, "experts")]
    assert len(mine) == (1 if weights is None else 2) and len(theirs) == 2
    for own, target in zip(mine, theirs[-len(mine) :], strict=True):  # layers=[0, 2] keeps layer 2's experts
        if weights == "int8":
            assert isinstance(own, Int8Experts) and own.gate_up_proj.dtype == torch.int8
            continue
        for name, param in own.named_parameters():
            target_param = getattr(target, name)
            if isinstance(weights, torch.dtype):
                assert param is not target_param and param.dtype == weights and target_param.dtype == torch.float32
            else:
                assert param is target_param
    assert all(p.dtype == torch.float32 for module in theirs for p in module.parameters())
    assert draft.model.layers[0].self_attn is not model.model.layers[0].self_attn  # the rest is the draft's own


def _routing(tokens: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    weights, index = scores.topk(k, dim=-1)  # [T, k] each: distinct experts per token
    return index, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("tokens", [1, 5, 40, 200])  # decode, a verification chunk: the kernel; prompts
def test_int8_experts_equal_the_experts_module_on_their_own_dequantized_weights(tokens):
    experts = tiny_model("mixtral").model.layers[0].mlp.experts
    int8 = Int8Experts.from_module(experts)
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=gen)
    index, weights = _routing(tokens, int8.num_experts, 2, seed=tokens)
    reference = copy.deepcopy(experts)
    with torch.no_grad():
        reference.gate_up_proj.copy_(int8.dequantized("gate_up_proj", torch.float32))
        reference.down_proj.copy_(int8.dequantized("down_proj", torch.float32))
        got, want, original = (
            int8(hidden, index, weights),
            reference(hidden, index, weights),
            experts(hidden, index, weights),
        )
    assert_close(got, want, atol=1e-5, rtol=1e-4, name=f"int8 experts, {tokens} tokens")  # fp32 sums, other order
    # against the float weights: the int8 rounding only (a relative error of a few per cent on random weights)
    assert ((got - original).norm() / original.norm()).item() < 0.05


def test_int8_experts_gate_on_a_weightless_copy_of_the_float_module():
    """The gating object keeps the module's settings, none of its tensors, and no wrapped ``forward`` (accelerate's
    hooks put one on the instance, holding the module): the float weights can go."""
    experts = tiny_model("gpt_oss").model.layers[0].mlp.experts
    experts.forward = lambda *args: None  # as a hook's wrapper would be
    int8 = Int8Experts.from_module(experts)
    shell = int8.gating
    assert shell is not experts and type(shell) is type(experts) and not list(shell.parameters())
    assert "forward" not in shell.__dict__ and (shell.alpha, shell.limit) == (experts.alpha, experts.limit)
    assert int8.gate_up_proj_bias is experts.gate_up_proj_bias  # shared, not copied


def test_int8_experts_refuse_a_layout_they_do_not_read():
    experts = tiny_model("mixtral").model.layers[0].mlp.experts
    experts.has_gate = False  # an up projection alone: no gate for Int8Experts to apply
    with pytest.raises(TypeError, match=r"MixtralExperts stores its experts as .*'has_gate': False"):
        Int8Experts.from_module(experts)
