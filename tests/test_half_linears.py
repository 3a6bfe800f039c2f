"""Half-precision decode linears (issue 32 item 2): the ``half_linear`` kernel against its reference, and bfloat16 /
float16 models patched with ``native=True`` against the unpatched model (the executor for the Llama family,
``half_linear`` linear by linear for the others)."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, assert_close, random_batch, router_linears, tiny_model
from torch import nn

import hf_accel
from hf_accel.kernels import reference
from hf_accel.kernels.build import cpu_isas
from hf_accel.kernels.ops import choose
from hf_accel.native.apply import NativeForward
from hf_accel.native.half import half_unavailable
from hf_accel.patch import default_config

KW = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
HALF_LINEARS_ARCH = "gemma"  # an architecture the executor does not serve: half_linear, linear by linear


def _kernel(isa: str):
    from hf_accel.kernels.build import extension

    module = extension(isa)
    if module is None:
        pytest.skip(f"no {isa} build here")
    return module.half_linear


@pytest.mark.parametrize("isa", cpu_isas() or ["avx2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("n", [200, 67])  # a partial 4-row tile, and rows left over after the tiles
def test_half_linear_matches_its_reference(isa, dtype, rows, n):
    fn = _kernel(isa)
    torch.manual_seed(rows * n)
    weight = (torch.randn(n, 256) * 0.05).to(dtype)
    x = torch.randn(rows, 256)
    # float32 sums of exactly widened weights: only the summation order differs
    assert_close(fn(x, weight), reference.half_linear(x, weight), atol=1e-5, rtol=1e-5, name=f"{isa} {dtype}")


def test_half_linear_refuses_what_it_cannot_take():
    fn = _kernel(cpu_isas()[0] if cpu_isas() else "avx2")
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        fn(torch.randn(1, 64), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="M <= 16"):
        fn(torch.randn(17, 64), torch.randn(8, 64).bfloat16())
    choice = choose("half_linear", "cpu", dtype=torch.bfloat16, in_features=60)
    assert not choice.native and "not a multiple" in " ".join(choice.rejected.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_on_a_half_model_runs_decode_rows_through_the_kernel(arch, dtype):
    plain = tiny_model(arch, dtype=dtype)
    patched = hf_accel.patch_model(tiny_model(arch, dtype=dtype), native=True)
    assert half_unavailable(patched) is None
    routers = router_linears(patched)  # MoE routers keep their own forward
    linears = [m for m in patched.modules() if type(m) is nn.Linear and not any(m is r for r in routers)]
    if isinstance(patched.forward, NativeForward):  # the executor serves the Llama family (tests/test_native_half.py)
        assert not any("forward" in m.__dict__ for m in linears)
    else:  # every other architecture: its decode rows through half_linear, linear by linear
        assert linears and all("forward" in m.__dict__ for m in linears)
    ids, mask = random_batch(1, [6], seed=2)  # 6 rows: every projection takes the kernel
    with torch.no_grad():
        got = patched(input_ids=ids, attention_mask=mask).logits.float()
        want = plain(input_ids=ids, attention_mask=mask).logits.float()
    # float32 sums in another order, rounded to the half dtype at each projection: a few half-precision ulps
    atol = 0.25 if dtype == torch.bfloat16 else 0.03
    assert_close(got, want, atol=atol, rtol=0.02, name=f"{arch} {dtype} logits")
    out = patched.generate(input_ids=ids, attention_mask=mask, **KW)  # decodes (tokens may differ at near-ties)
    assert out.shape == (1, 6 + 8)


def test_half_models_keep_the_keyword_only_default():
    config = default_config(tiny_model("llama", dtype=torch.bfloat16))
    assert config.native is None and config.speculative.auto is None


def test_weights_stay_the_modules_own_and_unpatch_removes_the_forwards():
    model = hf_accel.patch_model(tiny_model(HALF_LINEARS_ARCH, dtype=torch.bfloat16), native=True)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.Linear and "forward" in q_proj.__dict__
    report = hf_accel.patch_report(model)["implementations"]
    assert report["native"]["half_linear"]["uses"].startswith("cpu/")
    plain = tiny_model(HALF_LINEARS_ARCH, dtype=torch.bfloat16)
    ids, mask = random_batch(2, [4, 7], seed=5)
    with torch.no_grad():  # an in-place edit: the kernel reads the parameter on every call
        before = model(input_ids=ids[:1], attention_mask=mask[:1]).logits.float()
        for m in (model, plain):
            m.model.layers[1].mlp.down_proj.weight.mul_(3.0)
        got = model(input_ids=ids[:1], attention_mask=mask[:1]).logits.float()
        want = plain(input_ids=ids[:1], attention_mask=mask[:1]).logits.float()
    assert_close(got, want, atol=0.25, rtol=0.02, name="edited weights")
    assert not torch.allclose(got, before, atol=0.25)
    model.to(torch.float32)  # no half kernel for float32 weights: F.linear, the unpatched maths
    plain.to(torch.float32)
    assert torch.equal(model.generate(ids, attention_mask=mask, **KW), plain.generate(ids, attention_mask=mask, **KW))
    hf_accel.unpatch_model(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_float32_models_keep_the_executor_default():
    config = default_config(tiny_model("llama"))
    assert config.native is not None and config.speculative.auto == "self"
    assert "float32" in half_unavailable(tiny_model("llama"))
