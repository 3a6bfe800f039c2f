"""W8A8 (``Int8Config(activations="int8")``): tier (a) activation quantization and the exact reference,
tier (b) the integer-dot kernels (AVX-512 VNNI, AVX2) and ``Int8Linear`` against the reference / a float layer, tier
(c) models."""

import copy
import math

import pytest
import torch
from helpers import assert_close, chat_batch, greedy_answer, identical_prefixes, logits_of, random_batch, tiny_model
from torch import nn

import hf_accel
from hf_accel import IncompatibleOptionsError
from hf_accel.kernels.ops import native_builds
from hf_accel.quant import Int8Linear, dequantize, quantize
from hf_accel.quant.core import ACT_LANES, dequantize_activations, quantize_activations, w8a8_reference

#: every instruction-set build of the integer-dot kernels this CPU runs (AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw)
KERNELS = {isa: fn for isa, fn in native_builds("w8a8_linear").items() if fn is not None}
QUANTIZERS = {isa: fn for isa, fn in native_builds("quantize_activations").items() if fn is not None}
EVERY_ISA = ("avx512vnni", "avx512", "avx2")


def _each(builds: dict):
    return [pytest.param(fn, id=isa) for isa, fn in builds.items()] or [
        pytest.param(None, marks=pytest.mark.skip(reason="no integer-dot build on this CPU"))
    ]


def test_quantize_activations_exact_state():
    """Group l of a row: features k with (k % 64) // 4 == l, four adjacent features of every 64-feature block."""
    x = torch.zeros(2, 128)
    x[0, 0], x[0, 1], x[0, 67] = 2.0, -1.0, 0.5  # group 0 of row 0 (67 % 64 = 3): max 2 -> step 2/127
    x[0, 4], x[0, 64 + 7] = -0.25, 0.125  # group 1 of row 0: its own scale
    xq, scale = quantize_activations(x)
    assert xq.dtype == torch.int8 and scale.shape == (2, ACT_LANES)
    assert [xq[0, 0].item(), xq[0, 1].item(), xq[0, 67].item()] == [127, -64, 32]  # 63.5 -> 64 (half to even)
    assert xq[0, 4].item() == -127 and xq[0, 71].item() == 64  # 63.5 -> 64
    assert scale[0, 0].item() == pytest.approx(2.0 / 127, rel=1e-7)
    assert scale[0, 1].item() == pytest.approx(0.25 / 127, rel=1e-7)
    assert scale[0, 2:].tolist() == [0.0] * 14 and scale[1].tolist() == [0.0] * 16  # all-zero groups: scale 0
    assert not xq[1].any() and xq[0].count_nonzero().item() == 5
    deq = dequantize_activations(xq, scale)[0, [0, 1, 67, 4, 71]]  # each value times its own group's scale
    assert torch.equal(
        deq, torch.stack([scale[0, 0] * v for v in (127, -64, 32)] + [scale[0, 1] * v for v in (-127, 64)])
    )


def test_quantize_activations_bad_input():
    with pytest.raises(ValueError, match=r"W8A8 activations must be \[M, K\] with K a multiple of 64, got \(2, 100\)"):
        quantize_activations(torch.randn(2, 100))
    with pytest.raises(ValueError, match=r"W8A8 needs one weight scale per row, got group_size 32"):
        w8a8_reference(torch.randn(1, 64), quantize(torch.randn(4, 64), 32))


def test_w8a8_reference_is_the_integer_formula():
    torch.manual_seed(0)
    x, w = torch.randn(3, 128), torch.randn(5, 128)
    qw = quantize(w)
    xq, xs = quantize_activations(x)
    expected = torch.zeros(3, 5, dtype=torch.float64)
    for lane in range(ACT_LANES):
        cols = (torch.arange(128) % 64) // 4 == lane  # the group's 8 features
        dots = xq[:, cols].long() @ qw.qweight[:, cols].long().T  # exact integers
        expected += dots.double() * xs[:, lane : lane + 1].double()
    expected *= qw.scale.double().T
    assert torch.equal(w8a8_reference(x, qw), expected)  # float64 sums of exact integers: bitwise
    # and it is a linear layer: 8-bit activations and weights, ~1% relative error on gaussian data
    rel = (w8a8_reference(x, qw).float() - x @ w.T).norm() / (x @ w.T).norm()
    assert rel < 0.02, rel


@pytest.mark.parametrize("quantizer", _each(QUANTIZERS))
def test_kernel_quantizes_activations_bitwise_like_the_core(quantizer):
    torch.manual_seed(1)
    x = torch.randn(7, 192) * torch.logspace(-3, 2, 7).unsqueeze(1)
    x[2, (torch.arange(192) % 64) // 4 == 5] = 0  # an all-zero group
    x[4] = 0  # an all-zero row
    x[3, :64] = torch.arange(64) * (1.5 / 127)  # values on half-steps: the tie rule must match
    xq, scale, base = quantizer(x)
    ref_q, ref_scale = quantize_activations(x)
    assert torch.equal(xq, ref_q) and torch.equal(scale, ref_scale)
    assert scale[2, 5].item() == 0 and scale[4].abs().sum().item() == 0
    sums = ref_q.long().reshape(7, 3, ACT_LANES, 4).sum((1, 3))  # [M, 16]: the values' sum per group
    assert torch.equal(base, -128 * sums.int())  # each accumulator's start: cancels the unsigned weights' +128


@pytest.mark.parametrize("kernel", _each(KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 40])
@pytest.mark.parametrize("shape", [(64, 4), (192, 203), (576, 1536)])  # 203: a partial 4-row tile
def test_integer_dot_kernel_matches_the_exact_reference(kernel, rows, shape):
    k, n = shape
    torch.manual_seed(rows + k)
    x = torch.randn(rows, k) * 3
    qw = quantize(torch.randn(n, k))
    qw.qweight[0, : k // 2] = -128  # outside the quantizer's [-127, 127], inside int8: the kernels take it exactly
    qw.qweight[1, : k // 2] = 127
    got = kernel(x, qw.qweight, qw.scale)
    expected = w8a8_reference(x, qw)
    # integer dots are exact (int32 per group); only the fp32 sum of 16 scaled groups rounds: <= 1e-6 of the
    # output scale
    assert_close(got, expected.float(), atol=1e-6 * expected.abs().max().item(), rtol=0, name="kernel vs exact")


@pytest.mark.parametrize("kernel", _each(KERNELS))
def test_integer_dot_rows_are_batch_invariant(kernel):
    """A row's output does not depend on the other rows of the call (per-row scales, per-row tiles): bitwise."""
    torch.manual_seed(2)
    x, qw = torch.randn(11, 256), quantize(torch.randn(98, 256))  # 98: a tile of two weight rows at the end
    whole = kernel(x, qw.qweight, qw.scale)
    for r in (0, 5, 10):
        alone = kernel(x[r : r + 1].contiguous(), qw.qweight, qw.scale)
        assert torch.equal(alone[0], whole[r])


@pytest.mark.parametrize("emulated", [False, True])
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_linear_matches_float_layer_on_dequantized_values(pretend_cpu_lacks, emulated, rows, bias):
    """Against a float layer holding the de-quantized weights fed the de-quantized activations; and vs the original."""
    if emulated:
        pretend_cpu_lacks(*EVERY_ISA)
    elif not KERNELS:
        pytest.skip("no integer-dot build on this CPU")
    torch.manual_seed(rows)
    linear = nn.Linear(256, 200, bias=bias)
    q = Int8Linear.from_module(linear, activations="int8")
    x = torch.randn(2, rows, 256)  # [B, S, K]
    assert q.kernel_path(x) == ("w8a8-emulated" if emulated else "w8a8")
    xq, xs = quantize_activations(x.reshape(-1, 256))
    x_deq = dequantize_activations(xq, xs).reshape(2, rows, 256)
    with torch.no_grad():
        got, original = q(x), linear(x)
        expected = nn.functional.linear(x_deq, dequantize(q.quantized), linear.bias)
    assert_close(got, expected, atol=2e-5, rtol=1e-5, name="w8a8 vs float on de-quantized values")  # fp32 sums
    rel = ((got - original).norm() / original.norm()).item()
    assert rel < 0.02, rel  # 8-bit weights and activations: measured ~0.9% on gaussian data


def test_w8a8_bad_input():
    with pytest.raises(ValueError, match="needs in_features divisible by 64, got 100"):
        Int8Linear.from_module(nn.Linear(100, 8), activations="int8")
    with pytest.raises(ValueError, match=r"needs one weight scale per row \(group_size=None\), got 32"):
        Int8Linear.from_module(nn.Linear(128, 8), group_size=32, activations="int8")
    with pytest.raises(ValueError, match=r"activations must be one of \('float', 'int8'\), got 'fp8'"):
        Int8Linear(quantize(torch.randn(4, 64)), activations="fp8")
    with pytest.raises(IncompatibleOptionsError, match=r"Int8Config.group_size must be None with activations='int8'"):
        hf_accel.Int8Config(activations="int8", group_size=64)
    with pytest.raises(IncompatibleOptionsError, match=r"Int8Config.activations must be 'float' with backend="):
        hf_accel.Int8Config(activations="int8", backend="bitsandbytes")
    with pytest.raises(IncompatibleOptionsError, match=r"Int8Config.activations must be one of 'float', 'int8'"):
        hf_accel.Int8Config(activations="int4")
    model = tiny_model("llama", intermediate_size=96)  # down_proj reads 96 features
    with pytest.raises(
        IncompatibleOptionsError,
        match=r"model\.layers\.0\.mlp\.down_proj: activations='int8' needs in_features divisible by 64, got 96; "
        r"leave it in float with Int8Config\(skip_modules=\['model\.layers\.0\.mlp\.down_proj'\]\)",
    ):
        hf_accel.patch_model(model, int8=hf_accel.Int8Config(activations="int8"))
    assert not hf_accel.is_patched(model)
    hf_accel.patch_model(model, int8=hf_accel.Int8Config(activations="int8", skip_modules=("*.down_proj",)))
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear


def test_w8a8_model_level_every_architecture(tiny, arch):
    ids, mask = random_batch(3, [5, 9, 2], seed=4)
    before = logits_of(tiny, ids, mask)
    weight_only = logits_of(hf_accel.patch_model(copy.deepcopy(tiny), int8=True), ids, mask)
    hf_accel.patch_model(tiny, int8=hf_accel.Int8Config(activations="int8"))
    assert (
        "W8A8: activations quantized per token in 16 interleaved feature groups"
        in hf_accel.patch_report(tiny)["changes"]["int8"]
    )
    assert all(m.activations == "int8" for m in tiny.modules() if isinstance(m, Int8Linear))
    after = logits_of(tiny, ids, mask)
    rel = ((after - before).norm() / before.norm()).item()
    rel_weight_only = ((weight_only - before).norm() / before.norm()).item()
    # vs the original weights: quantization noise of a wide-init random model (weight-only measured 0.3-5.2%);
    # quantizing activations too adds about as much again
    assert rel < 0.1, f"{arch}: relative logits error {rel:.4f} (weight-only {rel_weight_only:.4f})"
    hf_accel.unpatch_model(tiny)
    assert all(type(m) is not Int8Linear for m in tiny.modules())


def test_w8a8_greedy_generate_batch_invariant_and_deepcopy():
    """Each row of a padded batch generates what it generates alone; an int8 model deep-copies."""
    model = tiny_model("llama")
    hf_accel.patch_model(model, int8=hf_accel.Int8Config(activations="int8"), paged=False)
    clone = copy.deepcopy(model)  # the kernels are looked up per call, not held by the modules
    ids, mask = random_batch(3, [4, 9, 6], seed=5)
    with torch.inference_mode():
        both = clone.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        for row in range(3):
            keep = mask[row].bool()
            alone = model.generate(input_ids=ids[row : row + 1, keep], max_new_tokens=8, do_sample=False)
            assert torch.equal(alone[0, -8:], both[row, -8:]), row


def test_w8a8_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen2")
    hf_accel.patch_model(model, int8=hf_accel.Int8Config(activations="int8"))
    ids, mask = random_batch(2, [4, 7])
    expected = logits_of(model, ids, mask)
    hf_accel.save_quantized(model, tmp_path / "q")
    loaded = hf_accel.load_quantized(tmp_path / "q")
    assert hf_accel.patch_report(loaded)["features"]["int8"]["activations"] == "int8"
    assert torch.equal(logits_of(loaded, ids, mask), expected)


def test_real_model_w8a8_perplexity_and_agreement(default_model, real_model_reference, capsys):
    model, tokenizer = default_model
    ref = real_model_reference  # the unpatched fp32 model's, computed once per session
    with torch.inference_mode():
        hf_accel.patch_model(model, int8=hf_accel.Int8Config(activations="int8", keep_original=True))
        try:
            ppl = math.exp(float(model(input_ids=ref["ids"], labels=ref["ids"]).loss))
            outs = [greedy_answer(model, tokenizer, p) for p in ref["prompts"]]
        finally:
            hf_accel.unpatch_model(model)
    agree = identical_prefixes(ref["answers"], outs)
    delta = (ppl / ref["perplexity"] - 1) * 100
    with capsys.disabled():
        print(f"\n[int8 W8A8 vs fp32] perplexity {ref['perplexity']:.3f} -> {ppl:.3f} ({delta:+.2f}%); "
              f"identical prefix (prompt + new tokens) per prompt: {agree}")  # fmt: skip
    assert delta < 1.0  # the bound; measured -0.43% on these 512 tokens
    prompt_lens = [int(chat_batch(tokenizer, [p])["input_ids"].shape[1]) for p in ref["prompts"]]
    assert all(a > n for a, n in zip(agree, prompt_lens, strict=True))  # every answer starts identically


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_int8_kernels_run_inside_the_compiled_paged_step(activations):
    """The int8 kernels are an opaque op in the compiled decode step (fullgraph: a graph break would fail)."""
    from hf_accel.compile.paged_step import CompiledPagedDecode

    cfg = hf_accel.Int8Config(activations=activations)
    trace = hf_accel.CompileConfig(backend="eager", fullgraph=True)
    eager = hf_accel.patch_model(tiny_model("llama"), int8=cfg, native=False)  # the modules' own maths, eagerly
    compiled = hf_accel.patch_model(tiny_model("llama"), int8=cfg, compile=trace)
    assert isinstance(compiled.forward, CompiledPagedDecode)
    ids, mask = random_batch(3, [4, 9, 6], seed=6)
    with torch.inference_mode():
        expected = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, paged=True)
        got = compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, paged=True)
    assert compiled.forward.steps == 7  # every decode step after the prompt ran compiled
    assert torch.equal(got, expected)  # the same kernels in and out of the graph (tiny model: no near-ties)


def test_emulated_w8a8_is_reported_and_warned(pretend_cpu_lacks, caplog):
    pretend_cpu_lacks(*EVERY_ISA)
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="hf_accel.quant.apply"):
        hf_accel.patch_model(model, int8=hf_accel.Int8Config(activations="int8"))
    report = hf_accel.patch_report(model)
    assert "W8A8 emulated in float (no integer-dot kernel)" in report["changes"]["int8"]
    lacks = {f"cpu/{isa}": f"(test) this CPU pretends to lack {isa.upper()}" for isa in EVERY_ISA}
    assert report["implementations"]["int8"]["w8a8_linear"] == {
        "uses": "reference",
        "why": "no native implementation takes this call",
        "not": lacks,
    }
    assert "W8A8 runs emulated in float (" + "; ".join(f"{k}: {v}" for k, v in lacks.items()) + ")" in caplog.text
    assert model.lm_head.kernel_path(torch.randn(1, 64)) == "w8a8-emulated"


def test_quantize_activations16_groups_and_bad_input():
    from hf_accel.quant.core import QuantizedWeight, quantize, quantize_activations16, w8a16_reference

    x = torch.zeros(1, 64)
    x[0, [0, 1, 2, 33]] = torch.tensor([2.0, -1.0, 3.0, 0.5])  # groups (k % 32) // 2: 0, 0, 1, 0
    xq, scale = quantize_activations16(x)
    assert scale[0, 0] == 2.0 / 32767 and scale[0, 1] == 3.0 / 32767 and not scale[0, 2:].any()
    assert xq[0, [0, 1, 2, 33]].tolist() == [32767, -16384, 32767, 8192]  # -16383.5 rounds half to even
    with pytest.raises(ValueError, match=r"W8A16 activations must be \[M, K\] with K a multiple of 32, got \(2, 48\)"):
        quantize_activations16(torch.randn(2, 48))
    grouped: QuantizedWeight = quantize(torch.randn(4, 64), group_size=32)
    with pytest.raises(ValueError, match=r"W8A16 needs one weight scale per row, got group_size 32"):
        w8a16_reference(torch.randn(2, 64), grouped)
