"""Exact codes (issue 32, item 4): float32 weights that are a de-quantized GGUF checkpoint's values, found again as
4-bit / 8-bit codes (``hf_accel.quant.codes``) and run from them by ``coded_linear`` and the native executor.

Tiers: (a) exact state: the codes found, their layout, bitwise decoding, and every refusal; (b) each CPU build's
``coded_linear`` against the reference (float32 rounding of the sums only) and bitwise for the weights it rebuilds;
(c) models: greedy tokens equal to the unpatched model at both initializer ranges, batches with padding, after
in-place weight edits, from threads, and what ``patch_report`` and the automatic speculation say.
"""

from __future__ import annotations

import pytest
import torch
from helpers import NO_AUTO_SPECULATION, as_gguf, assert_close, cpu_build, generate_in_threads, gguf_like, random_batch
from helpers import tiny_model as _tiny

import hf_accel
from hf_accel.kernels import reference
from hf_accel.kernels.build import cpu_isas
from hf_accel.native.apply import NativeForward
from hf_accel.native.layers import layers_choice
from hf_accel.quant.codes import Codes, find_codes

NO_EOS = dict(do_sample=False, eos_token_id=None)
BUILDS = [isa for isa in ("avx512vnni", "avx512", "avx2") if isa in cpu_isas()]
native_only = pytest.mark.skipif(layers_choice(set()) is None, reason="no native build on this CPU")


def _weight(kind: str, n: int = 48, k: int = 96, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "f32 scales":  # 4-bit codes whose scales and offsets are float32 values, not float16 ones
        d = torch.rand(n, k // 32, 1, generator=gen) * scale + scale / 10
        c = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
        c[..., 0], c[..., 1] = 0, 15  # the lowest and highest code in every group
        return ((d * c) + (-3 * d)).view(n, k)
    return gguf_like(torch.randn(n, k, generator=gen) * scale - scale / 3, kind)


# ------------------------------------------------------------------------------------------------ (a) exact state
@pytest.mark.parametrize(
    ("kind", "bits", "params"),
    [("q4_1", 4, torch.float16), ("q8_0", 8, torch.float16), ("q4_0", 8, torch.float16),
     ("f32 scales", 4, torch.float32)],
)  # fmt: skip
def test_codes_found_and_decoded_bitwise(kind, bits, params):
    weight = _weight(kind)
    codes = find_codes(weight)
    assert isinstance(codes, Codes) and codes.bits == bits and codes.shape == (48, 96)
    assert codes.codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert codes.codes.shape == ((48, 48) if bits == 4 else (48, 96)) and codes.params.shape == (48, 3, 2)
    assert codes.params.dtype == params  # float16 where every scale and offset is a float16 value (GGUF's)
    assert torch.equal(codes.decode(), weight)
    assert codes.nbytes == codes.codes.numel() * codes.codes.element_size() + 48 * 3 * 2 * params.itemsize


def _k_quant_blocks(kind: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """Random GGUF Q4_K / Q5_K super-blocks (float16 d / dmin, 12 bytes of 6-bit scales and mins, packed codes) as
    the gguf package de-quantizes them (what Transformers' ``gguf_file=`` loading runs): ``[rows, k]`` float32.
    Each group's codes span ``lo..hi`` with ``lo`` in 0..1 and ``hi`` in top-1..top, as fitted scales leave them."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    top = 15 if kind == "q4_k" else 31
    gen = np.random.default_rng(seed)
    blocks = rows * k // 256
    lo, hi = gen.integers(0, 2, (blocks, 8, 1)), gen.integers(top - 1, top + 1, (blocks, 8, 1))
    q = lo + np.floor(gen.random((blocks, 8, 32)) * (hi - lo + 1)).astype(np.int64)  # [blocks, 8 groups, 32]
    q[..., :1], q[..., 1:2] = lo, hi
    low = (q & 15).astype(np.uint8).reshape(blocks, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(blocks, 128)  # byte 32 i + l: groups 2i and 2i + 1
    d = gen.uniform(1e-4, 1e-3, (blocks, 2)).astype(np.float16).view(np.uint8)  # d, dmin
    scales = gen.integers(0, 256, (blocks, 12), dtype=np.uint8)
    parts = [d, scales]
    if kind == "q5_k":  # bit g of byte l: the fifth bit of group g's element l
        parts.append(sum(((q[:, g] >> 4) & 1).astype(np.uint8) << g for g in range(8)).astype(np.uint8))
    data = np.concatenate([*parts, qs], axis=1).reshape(rows, -1)
    qtype = gguf.GGMLQuantizationType.Q4_K if kind == "q4_k" else gguf.GGMLQuantizationType.Q5_K
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).view(rows, k)


@pytest.mark.parametrize(("kind", "bits"), [("q4_k", 4), ("q5_k", 8)])
def test_k_quant_codes_found_bitwise(kind, bits):
    """GGUF K-quants: each group's scale and offset are float32 products of float16 and 6-bit values, and a group's
    codes may stop short of either end; every group is found, with float32 parameters."""
    weight = _k_quant_blocks(kind, 24, 512, seed=3)
    codes = find_codes(weight)
    assert isinstance(codes, Codes), codes
    assert codes.bits == bits and codes.params.dtype == torch.float32 and torch.equal(codes.decode(), weight)
    emulated = gguf_like(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.05 - 0.01, kind)
    assert find_codes(emulated).bits == bits and torch.equal(find_codes(emulated).decode(), emulated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_values_are_sixteen_bit_codes(dtype):
    weight = (torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype).float()
    codes = find_codes(weight)
    assert codes.bits == 16 and codes.codes.dtype == dtype and codes.shape == (48, 96)
    assert codes.params.shape == (48, 0, 2) and codes.nbytes == 48 * 96 * 2
    assert torch.equal(codes.decode(), weight)


def test_four_bit_layout():
    """Byte j of a group holds element j (low nibble) and element j + 16 (high nibble); d, m per group."""
    c = torch.arange(32).remainder(16).float()  # one group: codes 0..15, 0..15
    weight = ((0.5 * c) + 1.0).view(1, 32)
    codes = find_codes(weight)
    assert codes.bits == 4 and codes.params.tolist() == [[[0.5, 1.0]]] and codes.params.dtype == torch.float16
    expected = [j | (j << 4) for j in range(16)]  # element j and j + 16 have the same code here
    assert codes.codes.view(-1).tolist() == expected


def test_constant_and_zero_groups():
    weight = torch.zeros(4, 64)
    weight[1] = 0.25
    weight[2, :32] = -3.0
    codes = find_codes(weight)
    assert isinstance(codes, Codes) and torch.equal(codes.decode(), weight)


@pytest.mark.parametrize(
    ("weight", "why"),
    [
        (torch.randn(8, 64), "no 4-bit or 8-bit codes"),
        (torch.randn(8, 48), "not a multiple of 32"),
        (torch.randn(8, 64).bfloat16(), "float32"),
        (torch.randn(64), "2-D"),
        (torch.empty(8, 64, device="meta"), "meta"),
    ],
)
def test_weights_without_codes_say_why(weight, why):
    found = find_codes(weight)
    assert isinstance(found, str) and why in found


def test_one_changed_value_breaks_the_codes():
    weight = _weight("q4_1")
    weight[3, 40] += 1e-3
    assert isinstance(find_codes(weight), str)
    weight = _weight("q4_1")
    weight[0, 0] = float("nan")
    assert "inf or NaN" in find_codes(weight)


# ------------------------------------------------------------------------------------------------ (b) kernels
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f32 scales"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32])
def test_coded_linear_matches_the_reference(isa, kind, rows):
    ext = cpu_build(isa)
    for n, k in ((70, 96), (5, 1536)):
        weight = _weight(kind, n, k, seed=rows)
        codes = find_codes(weight)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = ext.coded_linear(x, codes.codes, codes.params)
        expected = reference.coded_linear(x, codes.codes, codes.params)
        # float32 sums in another order: within a few ulps of the sums' magnitude
        assert_close(got, expected, atol=2e-6 * (x.abs() @ weight.abs().T).max().item(), rtol=0, name=f"{isa} {n}x{k}")


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0", "f32 scales"])
def test_coded_linear_rebuilds_the_weights_bitwise(isa, kind):
    """One-hot rows read single weights back: fl(fl(d * c) + m) exactly (two roundings, or one FMA where exact)."""
    weight = _weight(kind, 40, 128, seed=3, scale=0.7)
    codes = find_codes(weight)
    eye = torch.eye(128)
    for start in range(0, 128, 32):
        got = cpu_build(isa).coded_linear(eye[start : start + 32].contiguous(), codes.codes, codes.params)
        assert torch.equal(got, weight[:, start : start + 32].T), (isa, kind, start)


def test_coded_linear_refuses_bad_arguments():
    ext = cpu_build()
    if ext is None:
        pytest.skip("no native build on this CPU")
    codes = find_codes(_weight("q4_1"))
    with pytest.raises(RuntimeError, match="coded_linear"):
        ext.coded_linear(torch.randn(33, 96), codes.codes, codes.params)  # more than 32 rows
    with pytest.raises(RuntimeError, match="coded_linear"):
        ext.coded_linear(torch.randn(2, 64), codes.codes, codes.params)  # K mismatch
    with pytest.raises(RuntimeError, match="coded_linear"):
        ext.coded_linear(torch.randn(2, 96).double(), codes.codes, codes.params)


def test_coded_linear_op_runs_the_chosen_build():
    from hf_accel.kernels.ops import choose, op

    codes = find_codes(_weight("q4_1"))
    x = torch.randn(3, 96)
    got = op("coded_linear")(x, codes.codes, codes.params)
    assert_close(got, x @ codes.decode().T, atol=1e-5, rtol=1e-5, name="op")
    assert choose("coded_linear", "cpu").native == bool(BUILDS)


# ------------------------------------------------------------------------------------------------ (c) models
def _pair(arch: str, init: float, linears: str = "q4_1", **features):
    """The GGUF-like model unpatched, and a copy patched (native executor, codes on unless ``features`` say)."""
    plain = as_gguf(_tiny(arch, initializer_range=init), linears)
    patched = as_gguf(_tiny(arch, initializer_range=init), linears)
    return plain, hf_accel.patch_model(patched, **{**NO_AUTO_SPECULATION, "native": True, **features})


@native_only
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3"])
@pytest.mark.parametrize("init", [0.2, 0.02])
def test_coded_model_decodes_as_the_unpatched_model(arch, init):
    plain, patched = _pair(arch, init)
    step = patched.forward.step
    assert isinstance(patched.forward, NativeForward) and step.native.coded is not None
    assert step.head_codes is not None and step.head_codes.bits == 8
    projections = [t for t in step.native.flat if t.dim() == 2]  # q, k, v, o, [gate; up] (fused), down
    assert len(projections) == 6 * plain.config.num_hidden_layers
    assert all(any(t is w for w in projections) for t in step.native.coded_weights)
    assert len(step.native.coded_weights) == len(projections)
    for seed, lengths in enumerate([[7], [3, 8], [16], [5, 2, 9, 4]]):
        ids, mask = random_batch(len(lengths), lengths, seed=seed)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
        assert torch.equal(got, expected), (arch, init, seed)


@native_only
def test_coded_model_over_the_paged_cache_and_the_engine():
    plain, patched = _pair("llama", 0.02)
    ids, mask = random_batch(3, [4, 9, 6], seed=3)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    calls = patched.forward.calls
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, paged=True, **NO_EOS)
    assert torch.equal(got, expected) and patched.forward.calls > calls  # the executor's paged build ran
    prompts = [ids[row][mask[row].bool()].tolist() for row in range(3)]
    outs = patched.generate_many(prompts, max_new_tokens=10, eos_token_id=None)  # prompt + new tokens per row
    for row, out in enumerate(outs):
        assert out.tolist() == expected[row][mask[row].bool().tolist() + [True] * 10].tolist(), row


@native_only
@pytest.mark.parametrize("linears", ["q4_k", "q5_k"])
def test_k_quant_model_decodes_as_the_unpatched_model(linears):
    """Q4_K / Q5_K linears (float32 scales: the kernels' unfused path) give the unpatched model's tokens."""
    plain, patched = _pair("llama", 0.02, linears)
    coded = patched.forward.step.native.coded
    assert coded is not None and len(patched.forward.step.native.coded_weights) == 6 * plain.config.num_hidden_layers
    ids, mask = random_batch(2, [6, 11], seed=4)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS), expected)


@native_only
def test_q4_0_model_and_codes_off():
    plain, patched = _pair("llama", 0.02, "q4_0")
    assert patched.forward.step.native.coded is not None
    _, off = _pair("llama", 0.02, "q4_0", native=hf_accel.NativeConfig(exact_codes=False))
    assert off.forward.step.native.coded is None and off.forward.step.head_codes is None
    ids, mask = random_batch(2, [6, 9], seed=5)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    for model in (patched, off):
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS), expected)
    report = hf_accel.patch_report(off)["implementations"]["native"]["coded_linear"]
    assert report["uses"] == "off"


@native_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_checkpoint_loaded_as_float32_runs_half_weights(dtype):
    """A float32 model whose values are all bfloat16 / float16 ones (a half checkpoint loaded as float32) reads them
    as 16-bit weights, widened exactly: the unpatched float32 model's tokens."""
    plain = _tiny("llama", dtype=dtype, initializer_range=0.02).float()
    patched = hf_accel.patch_model(_tiny("llama", dtype=dtype, initializer_range=0.02).float(), native=True,
                                   **NO_AUTO_SPECULATION)  # fmt: skip
    step = patched.forward.step
    assert step.head_codes.bits == 16 and all(t.dtype == dtype for t in step.native.coded if t.dim() == 2)
    for seed, lengths in enumerate([[7], [3, 8, 5]]):
        ids, mask = random_batch(len(lengths), lengths, seed=seed)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
        assert torch.equal(got, expected), seed


def test_int8_on_a_coded_model_says_the_default_is_lossless_and_faster():
    model = hf_accel.patch_model(as_gguf(_tiny("llama")), int8=True)
    notes = " ".join(hf_accel.patch_report(model)["changes"]["int8"])
    assert "exact 4-bit codes of a quantized checkpoint" in notes
    plain = hf_accel.patch_model(_tiny("llama"), int8=True)
    assert "exact" not in " ".join(hf_accel.patch_report(plain)["changes"]["int8"])


@native_only
def test_float_model_reports_no_codes():
    patched = hf_accel.patch_model(_tiny("llama"), native=True, **NO_AUTO_SPECULATION)
    assert patched.forward.step.native.coded is None
    report = hf_accel.patch_report(patched)["implementations"]["native"]["coded_linear"]
    assert report["uses"] == "float weights" and "no 4-bit or 8-bit codes" in report["why"]


@native_only
def test_report_says_what_runs_from_codes():
    _, patched = _pair("llama", 0.2)
    report = hf_accel.patch_report(patched)
    assert report["implementations"]["native"]["coded_linear"]["uses"].startswith("cpu/")
    notes = " ".join(report["changes"]["native"])
    assert "exact 4/8-bit codes for 13 of 13 float32 weights" in notes  # 2 x 6 projections and the head


@native_only
@pytest.mark.parametrize("edit", ["in_place", "data", "load_state_dict"])
def test_weight_edits_reach_the_codes(edit):
    plain, patched = _pair("llama", 0.02)
    ids, mask = random_batch(1, [6], seed=2)
    patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, **NO_EOS)  # steps built from the codes
    other = as_gguf(_tiny("llama", seed=7, initializer_range=0.02))
    with torch.no_grad():
        for model in (plain, patched):
            weight = model.model.layers[1].mlp.down_proj.weight
            if edit == "in_place":
                weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 1e-3)  # no codes
            elif edit == "data":
                weight.data.copy_(other.model.layers[1].mlp.down_proj.weight)  # codes again, other ones
            else:
                model.load_state_dict(other.state_dict())
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, **NO_EOS)
    assert torch.equal(got, expected), edit
    coded = patched.forward.step.native.coded_weights
    down = patched.model.layers[1].mlp.down_proj.weight
    assert any(t.data_ptr() == down.data_ptr() for t in coded) == (edit != "in_place")


@native_only
def test_threads_share_a_coded_model():
    plain, patched = _pair("llama", 0.02)
    batches = [random_batch(2, None, seed=s) for s in range(4)]
    expected = [plain.generate(input_ids=i, attention_mask=m, max_new_tokens=8, **NO_EOS) for i, m in batches]
    got = generate_in_threads(patched, batches, max_new_tokens=8, **NO_EOS)
    for k in range(4):
        assert torch.equal(got[k], expected[k]), k


@native_only
def test_default_patch_does_not_speculate_over_coded_steps():
    """A step from 4-bit codes reads fewer bytes than an int8 draft's: greedy calls decode plainly (and say why);
    explicit speculation still runs and keeps the tokens."""
    plain = as_gguf(_tiny("llama", initializer_range=0.02))
    patched = hf_accel.patch_model(as_gguf(_tiny("llama", initializer_range=0.02)))
    ids, mask = random_batch(2, [5, 8], seed=1)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    assert torch.equal(got, expected)
    from hf_accel.core.call import GenerateCall
    from hf_accel.speculative.auto import DRAFT_SHARE, auto_refusal

    call = GenerateCall((), dict(input_ids=ids, attention_mask=mask, do_sample=False))
    assert "exact codes" in auto_refusal(patched, call)
    # 8-bit codes read about as many bytes as an int8 draft, whose kernel streams them faster: the draft pays there
    eight_bit = hf_accel.patch_model(as_gguf(_tiny("llama", initializer_range=0.02), "q8_0"))
    read, weights = eight_bit.forward.current_step().step_bytes()
    assert weights <= DRAFT_SHARE * read and auto_refusal(eight_bit, call) is None
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, prompt_lookup=True, **NO_EOS)
    assert torch.equal(got, expected)
