"""The core layer's helpers: token buffers, plain copies of patched models, the implementation record."""

from __future__ import annotations

import torch
from helpers import random_batch, tiny_model

import hf_accel
from hf_accel.core.state import STATE_ATTR, plain_copy
from hf_accel.core.tokens import TokenBuffer
from hf_accel.fused.packed import PackedLinear
from hf_accel.paged.layer import uses_paged_attention


def test_token_buffer_grows_in_place_and_views_stay_snapshots():
    buf = TokenBuffer([1, 2, 3], capacity=4)
    first = buf.view()
    buf.append(4)
    buf.extend([5, 6, 7])  # past the capacity: a bigger buffer
    assert buf.view().tolist() == [1, 2, 3, 4, 5, 6, 7] and len(buf) == 7
    assert first.tolist() == [1, 2, 3]  # a view taken before is what it was
    assert TokenBuffer().view().numel() == 0


def test_plain_copy_undoes_every_feature_on_the_copy_only():
    cfg = hf_accel.CompileConfig(backend="eager")
    original = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"), compile=cfg, native=True)
    ids, mask = random_batch(2, [4, 7], seed=3)
    expected = original.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    copy = plain_copy(patched)
    for name in (STATE_ATTR, "generate", "generate_many", "forward"):
        assert name not in vars(copy), name
    assert not hf_accel.is_patched(copy) and not uses_paged_attention(copy)
    assert not any(isinstance(m, PackedLinear) for m in copy.modules())
    got = copy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    assert hf_accel.is_patched(patched) and uses_paged_attention(patched)  # the original is untouched
    assert any(isinstance(m, PackedLinear) for m in patched.modules())
    assert torch.equal(plain_copy(original).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), expected)


def test_implementations_are_forgotten_on_unpatch():
    model = hf_accel.patch_model(tiny_model("llama"), int8=True)
    report = hf_accel.patch_report(model)["implementations"]
    assert report["int8"]["int8_linear"]["uses"].startswith(("cpu/", "reference"))
    state = vars(model)[STATE_ATTR]
    hf_accel.unpatch_model(model)
    assert state.recorder.choices == {}


def test_every_feature_with_a_kernel_reports_its_implementation():
    model = hf_accel.patch_model(tiny_model("llama"), compile=hf_accel.CompileConfig(backend="eager"))
    report = hf_accel.patch_report(model)["implementations"]
    paged = report["paged"]["paged_attention"]
    assert set(paged) == {"uses", "why", "not"} and paged["uses"] in (
        "cpu/avx512vnni",
        "cpu/avx512",
        "cpu/avx2",
        "gather",
    )
    panels = ("cpu/avx512vnni", "cpu/avx512", "cpu/avx2", "oneDNN packed GEMM")
    assert report["compile"]["panel_linear"]["uses"] in panels
    odd = hf_accel.patch_model(tiny_model("llama", head_dim=12), paged=hf_accel.PagedConfig(attention="kernel"))
    refused = hf_accel.patch_report(odd)["implementations"]["paged"]["paged_attention"]
    assert refused["uses"] == "refused" and "head_dim 12 is not a multiple of 8" in refused["why"]
