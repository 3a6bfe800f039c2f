"""Tier (b): the fused MLP equals the original module with identical weights."""

import pytest
import torch
from helpers import assert_close, tiny_model

import hf_accel
from hf_accel import FusedGatedMLP
from hf_accel.core.registry import resolve


@pytest.mark.parametrize("shape", [(1, 1), (4, 37)])
def test_fused_mlp_matches_original_module(arch, shape):
    model = tiny_model(arch)
    index = _first_dense(model)
    if index is None:  # every layer a mixture of experts: left to Transformers' experts implementation
        blocks = [layer.mlp for layer in model.model.layers]
        hf_accel.patch_model(model)
        assert [layer.mlp for layer in model.model.layers] == blocks
        return
    original = model.model.layers[index].mlp
    hidden = model.config.hidden_size
    x = torch.randn(*shape, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = original(x)
        hf_accel.patch_model(model)
        fused = model.model.layers[index].mlp
        assert isinstance(fused, FusedGatedMLP)
        got = fused(x)
    assert_close(got, expected, atol=1e-5, rtol=1e-4, name=f"{arch} {shape}")  # fp32, issue-5 tolerance


def _first_dense(model) -> int | None:
    """The index of the first decoder layer with a dense MLP (``None``: every layer is a mixture of experts)."""
    moe = resolve(model).moe_layers
    return next((i for i in range(len(model.model.layers)) if i not in moe), None)


def test_fused_mlp_with_bias():
    gate, up = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    down, act = torch.nn.Linear(16, 8), torch.nn.SiLU()
    weight, bias = FusedGatedMLP.fuse_weights(gate, up)
    fused = FusedGatedMLP(weight, bias, down, act)
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        assert_close(fused(x), down(act(gate(x)) * up(x)), atol=1e-6, rtol=1e-5, name="bias")  # fp32


def test_fuse_weights_rejects_mismatched_projections():
    with pytest.raises(ValueError, match=r"gate \(16, 8\) and up \(12, 8\) differ in shape"):
        FusedGatedMLP.fuse_weights(torch.nn.Linear(8, 16), torch.nn.Linear(8, 12))
    with pytest.raises(ValueError, match="both have a bias or both have none"):
        FusedGatedMLP.fuse_weights(torch.nn.Linear(8, 16), torch.nn.Linear(8, 16, bias=False))


@pytest.mark.parametrize("shape", [(1, 1), (4, 37)])
def test_from_module_every_architecture(arch, shape):
    """``FusedGatedMLP.from_module`` recognises each registry architecture's MLP without being told which."""
    model = tiny_model(arch)
    index = _first_dense(model)
    if index is None:  # a mixture of experts is not a gated MLP, and from_module says so
        with pytest.raises(TypeError, match=r"SparseMoeBlock|Moe is not a gated MLP hf_accel knows"):
            FusedGatedMLP.from_module(model.model.layers[0].mlp)
        return
    mlp = model.model.layers[index].mlp
    x = torch.randn(*shape, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = mlp(x)
        copied = FusedGatedMLP.from_module(mlp, share=False)
        assert_close(copied(x), expected, atol=1e-5, rtol=1e-4, name=f"{arch} copy")  # fp32
        fused = FusedGatedMLP.from_module(mlp)
        assert_close(fused(x), expected, atol=1e-5, rtol=1e-4, name=f"{arch} shared")  # fp32
        assert torch.equal(mlp(x), expected)  # the original still computes the same (its params are views now)
    fused_ptr = fused.gate_up_weight.data_ptr()
    if hasattr(mlp, "gate_proj"):  # split projections now view the fused weight: stored once
        assert mlp.gate_proj.weight.data_ptr() == fused_ptr
        assert copied.gate_up_weight.data_ptr() != mlp.gate_proj.weight.data_ptr()
    else:  # Phi-3's upstream-fused projection is used as it is
        assert mlp.gate_up_proj.weight.data_ptr() == fused_ptr


def test_from_module_rejects_unknown_modules():
    with pytest.raises(TypeError, match=r"Linear is not a gated MLP hf_accel knows: expected attributes "):
        FusedGatedMLP.from_module(torch.nn.Linear(4, 4))
