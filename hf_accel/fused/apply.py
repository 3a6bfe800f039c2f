"""Adapter: swap every decoder layer's gated MLP for a :class:`FusedGatedMLP` (per instance, recorded).

Dispatched models: an MLP whose weights accelerate offloads is left unfused (fusing would need them resident),
and said so; a replaced MLP's accelerate hook moves to its replacement. Tensor-parallel models: each rank fuses
its own column-wise shards of gate and up (this rank's ``[gate_shard; up_shard]``), the original shards become
views into it, and the row-wise ``down_proj`` keeps Transformers' all-reduce.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from ..core.call import GenerateCall
from ..core.config import FusedMLPConfig
from ..core.dispatch import is_offloaded, is_sharded, local_tensor, tp_style, transfer_hook
from ..core.errors import IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.registry import ArchSpec, ModelParts, get_attr_path, parent_and_name
from ..core.state import PatchState
from .mlp import FusedGatedMLP

__all__ = ["apply_fused_mlp", "bind_fused_mlp"]

logger = logging.getLogger(__name__)
FEATURE = "fused_mlp"
MOE_NOTE = "MLP left as is (a mixture of experts; Transformers' experts implementation runs it)"


def _fuse_one(mlp: nn.Module, spec: ArchSpec, recorder: Recorder) -> FusedGatedMLP:
    fused = FusedGatedMLP.from_module(mlp, spec, share=False)
    # The originals become views into the fused tensor, so the weights exist once in memory (recorded). Unpatching
    # gives them the fused module's values as they are then: after load_state_dict or model.to(...), the current
    # ones, in the current dtype and device.
    for (param, start, stop), what in zip(fused.weight_aliases, ("gate_proj", "up_proj"), strict=False):
        owner = get_attr_path(mlp, spec.gate_proj if what == "gate_proj" else spec.up_proj)
        _share(recorder, fused, param, "weight", start, stop, f"{what} weight shared")
        if fused.gate_up_proj.bias is not None:
            _share(recorder, fused, owner.bias, "bias", start, stop, f"{what} bias shared")
    return fused


def _share(recorder: Recorder, fused: FusedGatedMLP, param: nn.Parameter, kind: str, start: int, stop: int,
           what: str) -> None:  # fmt: skip
    def view() -> None:
        param.data = (
            fused.gate_up_proj.bias.data[start:stop] if kind == "bias" else fused.gate_up_weight.data[start:stop]
        )

    def copy_back() -> None:
        source = fused.gate_up_bias if kind == "bias" else fused.gate_up_weight
        param.data = source.detach()[start:stop].clone()

    recorder.call(FEATURE, what, view, copy_back)


def _check_tp_plan(model: nn.Module, prefix: str, spec: ArchSpec) -> None:
    styles = {p: tp_style(model, f"{prefix}.{p}") for p in (spec.gate_proj, spec.up_proj, spec.down_proj)}
    wanted = {spec.gate_proj: "colwise", spec.up_proj: "colwise", spec.down_proj: "rowwise"}
    if styles != wanted:
        raise IncompatibleOptionsError(
            f"fused_mlp cannot honour the tensor-parallel plan of {prefix}: {styles}; it fuses column-wise gate/up "
            "shards before a row-wise down_proj. Patch with fused_mlp=False"
        )


def _fuse_sharded(mlp: nn.Module, spec: ArchSpec, recorder: Recorder) -> FusedGatedMLP:
    """This rank's fused ``[gate_shard; up_shard]``; the DTensor shards become views into it."""
    gate, up = get_attr_path(mlp, spec.gate_proj), get_attr_path(mlp, spec.up_proj)
    pairs = [(gate.weight, up.weight)] + ([(gate.bias, up.bias)] if gate.bias is not None else [])
    fused = []
    for g, u in pairs:
        g_local, u_local = local_tensor(g), local_tensor(u)  # [I / tp, H] each (or [I / tp] biases)
        both = torch.cat([g_local.detach(), u_local.detach()], dim=0)  # [2 I / tp, H]
        rows = g_local.shape[0]

        def share(g_local=g_local, u_local=u_local, both=both, rows=rows) -> None:
            g_local.set_(both[:rows])
            u_local.set_(both[rows:])

        def unshare(g_local=g_local, u_local=u_local) -> None:
            g_local.set_(g_local.clone())
            u_local.set_(u_local.clone())

        recorder.call(FEATURE, "gate/up shards shared", share, unshare)
        fused.append(nn.Parameter(both, requires_grad=False))
    down = get_attr_path(mlp, spec.down_proj)
    return FusedGatedMLP(fused[0], fused[1] if len(fused) > 1 else None, down, get_attr_path(mlp, spec.act_fn))


def apply_fused_mlp(model: nn.Module, parts: ModelParts, config: FusedMLPConfig, recorder: Recorder) -> None:
    """Replace each layer's MLP with a fused one.

    Side effects:
        ``layer.<spec.mlp>`` is replaced on every decoder layer; the original gate/up parameters are
        re-pointed at halves of the fused weight. Both are recorded in ``recorder``.
    """
    del config  # the spec and the located layers carry everything needed
    spec = parts.spec
    for layer in parts:
        if layer.experts is not None:  # Transformers' experts forward runs a mixture of experts, and it is said so
            recorder.note(FEATURE, MOE_NOTE)
            continue
        projections = [get_attr_path(layer.mlp, p) for p in (spec.gate_proj, spec.up_proj, spec.gate_up_proj) if p]
        if any(type(p) is not nn.Linear for p in projections):  # e.g. already int8: left as it is, and said so
            recorder.note(FEATURE, "MLP left unfused (projections are not nn.Linear)")
            continue
        if is_offloaded(layer.mlp):
            recorder.note(FEATURE, "MLP left unfused (weights offloaded by accelerate)")
            logger.warning(
                "hf_accel: fused_mlp: layer %d's MLP weights are offloaded by accelerate; left unfused", layer.index
            )
            continue
        if any(is_sharded(p.weight) for p in projections):
            if spec.gate_up_proj is not None:
                recorder.note(FEATURE, "MLP left as is (fused upstream and tensor-parallel)")
                continue
            _check_tp_plan(model, f"{spec.layers}.{layer.index}.{spec.mlp}", spec)
            fused = _fuse_sharded(layer.mlp, spec, recorder)
        else:
            fused = _fuse_one(layer.mlp, spec, recorder)
        transfer_hook(layer.mlp, fused)
        parent, name = parent_and_name(layer.layer, spec.mlp)
        recorder.set_submodule(FEATURE, parent, name, fused, "MLP fused")


def bind_fused_mlp(model: nn.Module, state: PatchState, config: FusedMLPConfig) -> None:
    """A call hook that refuses PEFT adapters added after patching that target the projections fused MLPs replaced:
    PEFT does not find them there and leaves the adapter's weights for them out, silently."""
    del config
    hidden = [
        f"{name}.{attr}"
        for name, module in model.named_modules()
        if isinstance(module, FusedGatedMLP) and module.split_names
        for attr in module.split_names
    ]  # e.g. model.layers.0.mlp.gate_proj
    if not hidden:
        return

    def hook(model: nn.Module, call: GenerateCall) -> None:
        adapters = getattr(model, "peft_config", None)  # set by PEFT on the model it injects adapters into
        if not adapters:
            return
        for adapter, adapter_config in dict(adapters).items():
            missed = sorted({key.rpartition(".")[2] for key in hidden if _targets(adapter_config, key)})
            if missed:
                raise IncompatibleOptionsError(
                    f"PEFT adapter {adapter!r} targets {', '.join(missed)}, which fused_mlp replaced with one "
                    "gate_up_proj when the model was patched, so the adapter's weights for them were left out. Add "
                    "adapters before patching: model = peft_model.unload(); hf_accel.unpatch_model(model); add the "
                    "adapter again; hf_accel.patch_model(peft_model.get_base_model()) (adapter-wrapped projections "
                    "stay unfused). Or patch with fused_mlp=False"
                )

    state.call_hooks.append(hook)


def _targets(adapter_config: Any, key: str) -> bool:
    """Whether a PEFT config's ``target_modules`` names the module ``key`` (PEFT's rule: a regular expression
    matching the whole key, or a name equal to the key or to its last dotted parts)."""
    targets = getattr(adapter_config, "target_modules", None)
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    return any(key == t or key.endswith(f".{t}") for t in targets or ())
