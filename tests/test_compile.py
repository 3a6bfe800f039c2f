"""The compile feature: (a) config and errors, (b) PackedLinear / compiled MLP equivalence, (c) model level."""

import copy
import re

import pytest
import torch
from helpers import ARCHS, assert_close, logits_of, random_batch, tiny_config, tiny_model
from torch import nn

import hf_accel
from hf_accel import CompileConfig, IncompatibleOptionsError
from hf_accel.core.registry import ARCHITECTURES, resolve
from hf_accel.fused import FusedGatedMLP
from hf_accel.fused.packed import PackedLinear, packing_unavailable, panel_choice, unpack_linears
from hf_accel.speculative import SelfSpeculative

EAGER_TRACE = CompileConfig(backend="eager", mlp=True)  # dynamo tracing without Inductor: quick, same graph logic


def _mlp_form(arch: str) -> tuple[bool, str]:
    """What a fused MLP of ``arch`` compiles: whether the gate/up come fused, and the activation's name."""
    spec, config = ARCHITECTURES[arch], tiny_config(arch)
    act = next(v for v in (getattr(config, k, None) for k in spec.act_config_keys) if isinstance(v, str))
    return spec.gate_up_proj is not None, act


#: one architecture per MLP form: hf_accel's FusedGatedMLP is the module Inductor compiles, so the forms differ only
#: in these (every architecture runs the eager-backend trace)
MLP_FORMS = sorted({_mlp_form(arch): arch for arch in reversed(["llama", "gemma2", "phi3", *ARCHS])}.values())


# ---------------------------------------------------------------- (a) config and errors


def test_compile_config_validation_names_the_field():
    with pytest.raises(IncompatibleOptionsError, match=r"CompileConfig.backend must be one of 'inductor', "):
        CompileConfig(backend="tensorrt")
    with pytest.raises(IncompatibleOptionsError, match=r"CompileConfig.mode needs backend='inductor' \(backend is"):
        CompileConfig(mode="max-autotune", backend="eager")
    with pytest.raises(IncompatibleOptionsError, match=r"CompileConfig.prepack must be a bool, got 1"):
        CompileConfig(prepack=1)
    with pytest.raises(IncompatibleOptionsError, match=r"CompileConfig.mlp must be a bool, got 'yes'"):
        CompileConfig(mlp="yes")
    assert CompileConfig().compile_kwargs() == {
        "backend": "inductor",
        "fullgraph": False,
        "dynamic": None,  # PyTorch's default: static first, automatic dynamic on a changing dimension
        "mode": "default",
    }


def test_packing_unavailable_says_why():
    assert packing_unavailable(torch.empty(2, 2)) is None
    assert packing_unavailable(torch.empty(2, 2, device="meta")) == "weights on meta (oneDNN packing is a CPU layout)"
    assert packing_unavailable(torch.empty(2, 2, dtype=torch.float16)) == (
        "dtype torch.float16 (oneDNN packing takes float32 or bfloat16)"
    )
    with pytest.raises(ValueError, match=r"cannot pack this linear: dtype torch.float16"):
        PackedLinear.from_module(nn.Linear(4, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"PackedLinear.from_module needs an nn.Linear, got Conv1d"):
        PackedLinear.from_module(nn.Conv1d(4, 4, 1))
    packed = PackedLinear.from_module(nn.Linear(4, 3))
    with pytest.raises(TypeError, match=r"PackedLinear holds a torch.float32 CPU weight; got a torch.bfloat16 input"):
        packed(torch.randn(2, 4, dtype=torch.bfloat16))


# ---------------------------------------------------------------- (b) modules


LAYOUTS = ["onednn", "panel"]
needs_panel = pytest.mark.skipif(
    not panel_choice(torch.zeros(16, 16)).native, reason="the panel kernel needs an AVX2 or AVX-512 CPU"
)
#: the widest panel build, and the AVX2 one (two ymm per panel step) by pretending the CPU lacks AVX-512
PANEL_BUILDS = [pytest.param((), id="widest"), pytest.param(("avx512vnni", "avx512"), id="avx2")]


def _layout_marks(layout: str):
    return pytest.param(layout, marks=needs_panel) if layout == "panel" else layout


@pytest.mark.parametrize("shape", [(1, 1), (4, 37)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", [_layout_marks(x) for x in LAYOUTS])
def test_packed_linear_matches_linear(shape, bias, layout):
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=bias)
    packed = PackedLinear.from_module(linear, layout=layout)
    assert packed.layout == layout
    x = torch.randn(*shape, 576)
    with torch.no_grad():
        assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-4, name="packed vs F.linear")  # fp32
    assert torch.equal(packed.dense_weight(), linear.weight)  # packing re-orders, never rounds
    assert packed.bias is linear.bias  # shared, not copied
    again = packed.to_linear()
    assert torch.equal(again.weight, linear.weight) and again.bias is linear.bias
    twin = copy.deepcopy(packed)
    assert torch.equal(twin.dense_weight(), linear.weight) and (not bias or twin.bias is not linear.bias)
    with torch.no_grad():
        assert torch.equal(twin(x), packed(x))


@needs_panel
@pytest.mark.parametrize("lacks", PANEL_BUILDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 11, 16, 64, 300])
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (1536, 576), (576, 192), (100, 48)])
def test_panel_kernel_every_row_count(pretend_cpu_lacks, lacks, rows, k, n):
    """Every tile shape of the kernel (AVX-512: 1, 2, 4-row tiles with 1-3 row remainders, 8 / 6-panel tiles and
    1-panel leftovers; AVX2: 6 / 2 / 1-panel tiles)."""
    pretend_cpu_lacks(*lacks)
    if lacks:
        assert panel_choice(torch.zeros(16, 16)).impl == "cpu/avx2"
    torch.manual_seed(rows)
    linear = nn.Linear(k, n, bias=rows % 2 == 1)
    packed = PackedLinear.from_module(linear, layout="panel")
    x = torch.randn(rows, k)
    with torch.no_grad():
        assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-4, name=f"panel M={rows}")  # fp32, order only


def test_layout_choice_and_errors():
    if packing_unavailable(torch.empty(2, 2, dtype=torch.bfloat16)) is None:
        assert PackedLinear.from_module(nn.Linear(8, 16, dtype=torch.bfloat16)).layout == "onednn"  # fp32 kernel only
    assert PackedLinear.from_module(nn.Linear(8, 12)).layout == "onednn"  # 12 outputs: not whole panels
    with pytest.raises(ValueError, match=r"layout must be one of \('auto', 'panel', 'onednn'\), got 'fast'"):
        PackedLinear.from_module(nn.Linear(8, 16), layout="fast")
    with pytest.raises(
        ValueError, match=r"cannot pack this linear in panels: (.*; )?out_features 12 is not a multiple of 16"
    ):
        PackedLinear.from_module(nn.Linear(8, 12), layout="panel")
    expected = "panel" if panel_choice(torch.zeros(16, 16)).native else "onednn"
    assert PackedLinear.from_module(nn.Linear(8, 16)).layout == expected


def test_bfloat16_packing_needs_onednn_bf16_kernels(monkeypatch):
    # AVX2-only CPUs (Zen 3, older Intel) have no oneDNN bf16 kernels: oneDNN's reorder raises a RuntimeError there,
    # so packing says why first, and the compile feature leaves the bf16 linears as they are
    monkeypatch.setattr(hf_accel.fused.packed, "_onednn_bf16", lambda: False)
    reason = r"bfloat16 on a CPU without oneDNN's bf16 kernels \(they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT"
    with pytest.raises(ValueError, match="cannot pack this linear: " + reason):
        PackedLinear.from_module(nn.Linear(8, 16, dtype=torch.bfloat16))
    packed = PackedLinear.from_module(nn.Linear(8, 16))
    packed.to(torch.bfloat16)  # a packed float32 module cast to bf16 keeps a dense weight
    assert packed.layout == "dense" and packed.dense_weight().dtype == torch.bfloat16
    model = tiny_model("llama").to(torch.bfloat16)
    reference = copy.deepcopy(model)
    hf_accel.patch_model(model, compile=EAGER_TRACE)
    changes = hf_accel.patch_report(model)["changes"]["compile"]
    assert any(re.match("linears not packed: " + reason, change) for change in changes), changes
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    ids, mask = random_batch(2, [6, 4], seed=3)
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False}
    assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


@pytest.mark.skipif(
    packing_unavailable(torch.empty(2, 2, dtype=torch.bfloat16)) is not None, reason="no oneDNN bf16 kernels here"
)
def test_packed_linear_bfloat16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, dtype=torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        # bf16 products accumulate in fp32 in both kernels; rounding of the output differs by <= 1 bf16 ulp
        assert_close(PackedLinear.from_module(linear)(x), linear(x), atol=2e-2, rtol=1e-2, name="bf16 packed")


@pytest.mark.parametrize(("arch", "backend"), [(a, "eager") for a in ARCHS] + [(a, "inductor") for a in MLP_FORMS])
def test_compiled_fused_mlp_matches_original(arch, backend):
    model = tiny_model(arch)
    originals = [copy.deepcopy(layer.mlp) for layer in model.model.layers]
    moe = set(resolve(model).moe_layers)
    hf_accel.patch_model(model, fused_mlp=True, compile=CompileConfig(backend=backend, mlp=True), paged=False)
    hidden = model.config.hidden_size
    for i, (layer, original) in enumerate(zip(model.model.layers, originals, strict=True)):
        mlp = layer.mlp
        if i in moe:  # a mixture of experts: Transformers' experts implementation runs it, as it was
            assert type(mlp) is type(original)
            continue
        assert isinstance(mlp, FusedGatedMLP) and isinstance(mlp.gate_up_proj, PackedLinear)
        for shape in ((1, 1, hidden), (4, 37, hidden)):  # decode: compiled; prefill-sized: eager, packed
            x = torch.randn(*shape)
            with torch.no_grad():
                assert_close(mlp(x), original(x), atol=1e-5, rtol=1e-4, name=f"{arch} {backend} {shape}")  # fp32


# ---------------------------------------------------------------- (c) model level


#: Inductor compiles the whole decode step of one architecture of each attention form (the eager-backend trace runs
#: for every architecture): Llama's, soft-capped sliding layers, fused q/k/v, q/k norms, NoPE layers, parallel
#: attention and MLP with NoPE full layers, a partial interleaved rotary embedding, a dense layer then a mixture of
#: experts (Transformers' grouped-matmul experts inside the compiled step)
STEP_FORMS = ["llama", "gemma2", "phi3", "qwen3", "smollm3", "cohere2", "glm4", "glm4_moe"]


@pytest.mark.parametrize(
    ("arch", "backend"), [(a, "eager") for a in ARCHS] + [(a, "inductor") for a in STEP_FORMS if a in ARCHS]
)
def test_greedy_identical_every_architecture(arch, backend):
    tiny = tiny_model(arch)
    ids, mask = random_batch(3, [4, 9, 12], seed=5)
    expected = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    before = logits_of(tiny, ids, mask)
    hf_accel.patch_model(tiny, compile=CompileConfig(backend=backend, mlp=True))
    got = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected), arch
    paged = tiny.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, paged=True)
    assert torch.equal(paged, expected), arch
    assert_close(logits_of(tiny, ids, mask), before, atol=1e-4, rtol=1e-4, name=f"{arch} logits")  # fp32
    hf_accel.unpatch_model(tiny)
    assert torch.equal(logits_of(tiny, ids, mask), before)  # bitwise: the packed values come back as they were


@needs_panel
def test_greedy_identical_on_the_avx2_panel_build(pretend_cpu_lacks):
    pretend_cpu_lacks("avx512vnni", "avx512")
    model = tiny_model("llama", initializer_range=0.02)
    ids, mask = random_batch(3, [4, 9, 12], seed=7)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hf_accel.patch_model(model, compile=CompileConfig(backend="eager", mlp=True))
    assert hf_accel.patch_report(model)["implementations"]["compile"]["panel_linear"]["uses"] == "cpu/avx2"
    assert model.model.layers[0].mlp.gate_up_proj.layout == "panel"
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)


def test_cpu_default_packs_without_compiling_mlps():
    model = tiny_model("llama")
    hf_accel.patch_model(model, compile=True)
    changes = hf_accel.patch_report(model)["changes"]["compile"]
    assert changes["MLPs not compiled (CPU default: slower than packed eager; mlp=True forces it)"] == 1
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, PackedLinear)
    assert model.model.layers[0].mlp._compiled is None


def test_float_weights_released_while_packed_and_restored():
    model = tiny_model("llama", tie_word_embeddings=True)
    gate = model.model.layers[0].mlp.gate_proj.weight
    q = model.model.layers[0].self_attn.q_proj.weight
    saved = gate.detach().clone(), q.detach().clone()
    hf_accel.patch_model(model, compile=EAGER_TRACE)
    assert gate.numel() == 0 and q.numel() == 0  # the packed copies hold the values: no doubled memory
    assert isinstance(model.lm_head, PackedLinear) and model.model.embed_tokens.weight.numel() > 0  # tied: kept
    changes = hf_accel.patch_report(model)["changes"]["compile"]
    assert changes["tied lm_head packed (its float weight stays for the embedding)"] == 1
    assert changes["fused MLP compiled (decode shapes)"] == 2
    hf_accel.unpatch_model(model)
    assert torch.equal(gate, saved[0]) and torch.equal(q, saved[1])
    assert type(model.model.layers[0].mlp.gate_proj) is nn.Linear


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_no_recompilation_across_generate_calls_of_one_shape_class(backend):
    torch._dynamo.reset()
    model = tiny_model("llama")
    hf_accel.patch_model(model, compile=CompileConfig(backend=backend, mlp=True))
    ids, mask = random_batch(2, [5, 8], seed=1)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    compiled = _unique_graphs()
    assert compiled >= 1  # the decode-shaped MLP graph
    for lengths, new in (([3, 11], 9), ([7, 7], 4), ([12, 2], 12)):  # other prompt lengths, other lengths out
        ids, mask = random_batch(2, lengths, seed=2)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    assert _unique_graphs() == compiled  # same batch size: the graphs are reused, prompts run eagerly


def test_static_cache_calls_get_a_compiled_decode_step():
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids, mask = random_batch(2, [5, 8], seed=3)
    expected = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static"
    )
    hf_accel.patch_model(model, compile=CompileConfig(backend="eager", mlp=False))
    before = _unique_graphs()
    got = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static"
    )
    assert torch.equal(got, expected)
    assert _unique_graphs() > before  # Transformers compiled its decode step on CPU because we asked it to
    compiled = _unique_graphs()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert _unique_graphs() == compiled  # the second identical call reuses it


def test_self_speculative_copy_of_a_packed_model():
    model = tiny_model("llama")
    ids, mask = random_batch(2, [5, 8], seed=4)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hf_accel.patch_model(model, compile=EAGER_TRACE)
    spec = SelfSpeculative("int8")
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, speculative=spec)
    assert torch.equal(got, expected)
    twin = copy.deepcopy(model.model.layers[0].mlp)
    assert twin._compiled is None  # copies run eagerly
    assert unpack_linears(twin) == 2 and type(twin.gate_up_proj) is nn.Linear


# the whole compiled paged step without compiled MLPs (the CPU default) on the real model is test_paged_compiled's
# test_real_model_greedy_identical_compiled; here the step compiled by region runs with compiled MLPs inside its layer
# graph (with an empty Inductor cache 12 s here against 100 s for the whole step; tiny models of every architecture
# run compiled MLPs inside the whole step)
@pytest.mark.parametrize("mlp", [False, True])
def test_real_model_greedy_identical(default_model, mlp):
    from helpers import chat_batch

    model, tokenizer = default_model
    inputs = chat_batch(tokenizer, ["What is the capital of France?", "Write a haiku about autumn leaves."])
    with torch.inference_mode():
        expected = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        hf_accel.patch_model(model, compile=CompileConfig(mlp=mlp, regional=True))
        try:
            got = model.generate(**inputs, max_new_tokens=24, do_sample=False)
            paged = model.generate(**inputs, max_new_tokens=24, do_sample=False, paged=True) if mlp else expected
            assert model.forward.regional and model.forward.steps == (23 if mlp else 0)
        finally:
            hf_accel.unpatch_model(model)
        again = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, expected) and torch.equal(paged, expected)
    assert torch.equal(again, expected)


def test_weights_packed_under_inference_mode_fingerprint_for_the_prefix_cache():
    """Packing inside ``torch.inference_mode()`` makes inference tensors (no version counter): the prefix cache's
    weights fingerprint must still be computable."""
    plain = tiny_model("llama")
    with torch.inference_mode():
        model = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(decode_step=False))
        ids, mask = random_batch(2, [6, 9], seed=3)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        got = model.generate(**kwargs, paged=hf_accel.PagedConfig(prefix_cache=True))
        assert torch.equal(got, plain.generate(**kwargs))


def test_resizing_a_packed_lm_head_is_refused_with_the_way_round():
    """``resize_token_embeddings`` reads the LM head's ``weight``, which a packed head re-lays out: a typed error
    that says what to do (int8's refusal is its own); unpatch, resize and patch again gives the resized model."""
    plain = tiny_model("llama")
    ids, mask = random_batch(2, [5, 9], seed=1)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    patched = hf_accel.patch_model(copy.deepcopy(plain), compile=CompileConfig(backend="eager"))
    with pytest.raises(IncompatibleOptionsError, match="cannot resize a packed LM head"):
        patched.resize_token_embeddings(300)
    hf_accel.unpatch_model(patched)
    assert "resize_token_embeddings" not in vars(patched)
    for model in (plain, patched):
        torch.manual_seed(0)
        model.resize_token_embeddings(300)
    hf_accel.patch_model(patched, compile=CompileConfig(backend="eager"))
    assert torch.equal(patched.generate(**kw, paged=True), plain.generate(**kw))
    unpacked = hf_accel.patch_model(copy.deepcopy(plain), compile=CompileConfig(backend="eager", prepack=False))
    unpacked.resize_token_embeddings(310)  # nothing packed: Transformers' own resize
    assert unpacked.get_output_embeddings().weight.shape[0] == 310


@pytest.mark.parametrize("tied", [True, False])
def test_num_parameters_counts_packed_linears_as_the_parameters_they_replaced(tied):
    plain = tiny_model("llama", tie_word_embeddings=tied)
    patched = hf_accel.patch_model(copy.deepcopy(plain), compile=CompileConfig(backend="eager"))
    assert any(isinstance(m, PackedLinear) for m in patched.modules())
    for exclude in (False, True):
        assert patched.num_parameters(exclude_embeddings=exclude) == plain.num_parameters(exclude_embeddings=exclude)
    hf_accel.unpatch_model(patched)
    assert "num_parameters" not in vars(patched) and patched.num_parameters() == plain.num_parameters()
