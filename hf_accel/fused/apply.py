"""Adapter: swap every decoder layer's gated MLP for a :class:`FusedGatedMLP` (per instance, recorded)."""

from __future__ import annotations

from torch import nn

from ..config import FusedMLPConfig
from ..recorder import Recorder
from ..registry import ArchSpec, ModelParts, get_attr_path, parent_and_name
from .mlp import FusedGatedMLP

__all__ = ["apply_fused_mlp"]

FEATURE = "fused_mlp"


def _fuse_one(mlp: nn.Module, spec: ArchSpec, recorder: Recorder) -> FusedGatedMLP:
    down = get_attr_path(mlp, spec.down_proj)
    act = get_attr_path(mlp, spec.act_fn)
    if spec.gate_up_proj is not None:  # already fused upstream (Phi-3): share the parameter as is
        gate_up = get_attr_path(mlp, spec.gate_up_proj)
        return FusedGatedMLP(gate_up.weight, gate_up.bias, down, act)
    gate = get_attr_path(mlp, spec.gate_proj)
    up = get_attr_path(mlp, spec.up_proj)
    weight, bias = FusedGatedMLP.fuse_weights(gate, up)
    rows = gate.weight.shape[0]
    # The originals become views into the fused tensor, so the weights exist once in memory.
    recorder.set_param_data(FEATURE, gate.weight, weight.data[:rows], "gate_proj weight shared")
    recorder.set_param_data(FEATURE, up.weight, weight.data[rows:], "up_proj weight shared")
    if bias is not None:
        recorder.set_param_data(FEATURE, gate.bias, bias.data[:rows], "gate_proj bias shared")
        recorder.set_param_data(FEATURE, up.bias, bias.data[rows:], "up_proj bias shared")
    fused = FusedGatedMLP(weight, bias, down, act)
    fused.weight_aliases = [(gate.weight, 0, rows), (up.weight, rows, 2 * rows)]
    return fused


def apply_fused_mlp(model: nn.Module, parts: ModelParts, config: FusedMLPConfig, recorder: Recorder) -> None:
    """Replace each layer's MLP with a fused one.

    Side effects:
        ``layer.<spec.mlp>`` is replaced on every decoder layer; the original gate/up parameters are
        re-pointed at halves of the fused weight. Both are recorded in ``recorder``.
    """
    del model, config  # the spec and the located layers carry everything needed
    spec = parts.spec
    for layer in parts:
        projections = [get_attr_path(layer.mlp, p) for p in (spec.gate_proj, spec.up_proj, spec.gate_up_proj) if p]
        if any(type(p) is not nn.Linear for p in projections):  # e.g. already int8: left as it is, and said so
            recorder.note(FEATURE, "MLP left unfused (projections are not nn.Linear)")
            continue
        fused = _fuse_one(layer.mlp, spec, recorder)
        parent, name = parent_and_name(layer.layer, spec.mlp)
        recorder.set_submodule(FEATURE, parent, name, fused, "MLP fused")
