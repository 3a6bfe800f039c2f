"""The ``compile`` feature: pre-packed linear weights, compiled fused MLPs, a compiled static-cache decode step.

Three independent parts (see :class:`~hf_accel.core.config.CompileConfig`):

* ``prepack`` — every ``nn.Linear`` of the decoder layers (the fused ``gate_up_proj`` included) and the LM
  head becomes a :class:`~hf_accel.fused.packed.PackedLinear`. The float weight is released (the packed copy holds
  the same values) and restored bitwise by ``unpatch_model``; a tied LM head keeps its float weight for the embedding.
* ``mlp`` — each :class:`~hf_accel.fused.mlp.FusedGatedMLP` routes decode steps (``[B, 1, H]``) through one
  ``torch.compile``'d function shared by all layers (weights are arguments, so 30 layers are one graph, not 30
  recompiles).
* ``decode_step`` — decode steps and short verification chunks over hf_accel's paged cache run compiled
  (:class:`~.paged_step.CompiledPagedDecode`, bound as the instance's ``forward`` when the paged
  feature is on), and a ``generate`` call with ``cache_implementation="static"`` gets Transformers'
  ``compile_config`` (with CPU allowed), so Transformers compiles its decode step.

Nothing is compiled at patch time: compilation happens on the first call of each shape class.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.call import GenerateCall, device_of
from ..core.config import CompileConfig
from ..core.dispatch import check_resident, is_sharded, transfer_hook
from ..core.errors import FeatureNotAvailableError, IncompatibleOptionsError
from ..core.gate import GATE_KEY
from ..core.recorder import Recorder
from ..core.registry import ModelParts, decoder_linears, get_attr_path, parent_and_name
from ..fused.mlp import FusedGatedMLP
from ..fused.packed import PackedLinear, define_compiled_op, packing_unavailable, panel_choice, unpack_linears
from ..paged.layer import uses_paged_attention
from ..paged.step_op import define_paged_op
from .paged_step import CompiledPagedDecode
from .regional import RegionalLayer, layer_slots

if TYPE_CHECKING:
    from ..core.state import PatchState

__all__ = ["apply_compile", "bind_compile", "plain_compile"]

logger = logging.getLogger(__name__)
FEATURE = "compile"


def _release(recorder: Recorder, weight: nn.Parameter, packed: PackedLinear, aliases: list[Any]) -> None:
    """Free the float weight (and the original parameters viewing it); unpatch re-creates them from ``packed``."""

    def restore() -> None:
        dense = packed.dense_weight()  # bitwise the packed values
        weight.data = dense
        for alias, start, stop in aliases:
            alias.data = dense[start:stop]

    params = [weight, *(alias for alias, _, _ in aliases)]
    recorder.release(FEATURE, "float weight released (the packed copy holds it)", params, restore)


def _prepack(model: nn.Module, parts: ModelParts, recorder: Recorder) -> None:
    targets = decoder_linears(model, parts.spec)
    for name, linear in targets:
        check_resident(name, linear, "compile (weight pre-packing)", "patch with CompileConfig(prepack=False)")
        if is_sharded(linear.weight):
            raise FeatureNotAvailableError(
                f"compile cannot pre-pack the tensor-parallel shard {name}; patch with CompileConfig(prepack=False)"
            )
    why = packing_unavailable(targets[0][1].weight) if targets else "no nn.Linear to pack"
    if why is not None:
        recorder.note(FEATURE, f"linears not packed: {why}")
        logger.info("hf_accel: compile: linear weights not packed (%s)", why)
        return
    panel = panel_choice(targets[0][1].weight)
    recorder.choose(FEATURE, "panel_linear", panel.impl if panel.native else "oneDNN packed GEMM", panel.why,
                    panel.rejected)  # fmt: skip
    embedding = getattr(model.get_input_embeddings(), "weight", None)  # an Int8Embedding has none
    if "num_parameters" not in vars(model):  # packed weights are not parameters: count them as the ones they replace
        count = types.MethodType(_num_parameters, model)
        recorder.set_instance_attr(FEATURE, model, "num_parameters", count, "num_parameters counts packed linears")
    if any(name == parts.spec.lm_head for name, _ in targets) and "resize_token_embeddings" not in vars(model):
        recorder.refuse_method(FEATURE, model, "resize_token_embeddings", _RESIZE_REFUSAL,
                               "resize_token_embeddings refused (packed LM head)")  # fmt: skip
    aliases = {id(m.gate_up_proj.weight): m.weight_aliases for m in model.modules() if isinstance(m, FusedGatedMLP)}
    for name, linear in targets:
        packed = PackedLinear.from_module(linear)
        transfer_hook(linear, packed)
        parent, attr = parent_and_name(model, name)
        recorder.set_submodule(FEATURE, parent, attr, packed, "Linear -> PackedLinear")
        if linear.weight is embedding:
            recorder.note(FEATURE, "tied lm_head packed (its float weight stays for the embedding)")
            continue
        _release(recorder, linear.weight, packed, aliases.get(id(linear.weight), []))


def _num_parameters(self: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """As the unpatched model counts: a packed linear's weight (no parameter any more) as the parameter it replaced,
    except a tied LM head's, which is the embedding matrix (counted already)."""
    count = type(self).num_parameters(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    if only_trainable:  # packed weights are not trainable
        return count
    tied = getattr(self.get_input_embeddings(), "weight", None) is not None and bool(
        getattr(self.config, "tie_word_embeddings", False)
    )
    head = self.get_output_embeddings()
    for module in self.modules():
        if isinstance(module, PackedLinear) and not (tied and module is head):
            count += module.in_features * module.out_features
    return count


_RESIZE_REFUSAL = (
    "resize_token_embeddings cannot resize a packed LM head (hf_accel's compile feature re-lays its weight out): "
    "resize before patching, or hf_accel.unpatch_model(model) (the exact weights come back), resize, then patch "
    "again; or patch with CompileConfig(prepack=False)"
)


def _projection_args(proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    if isinstance(proj, PackedLinear):
        return proj.packed, proj.bias, True
    if type(proj) is nn.Linear:
        return proj.weight, proj.bias, False
    raise IncompatibleOptionsError(f"compiled MLPs need nn.Linear or PackedLinear projections, got {type(proj)}")


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, n: int) -> torch.Tensor:
    if packed:
        return torch.ops.hf_accel.packed_linear(x, weight, bias, n)
    return torch.nn.functional.linear(x, weight, bias)


def _make_mlp_fn(act: nn.Module) -> Callable[..., torch.Tensor]:
    """One function for every layer's MLP: weights come in as arguments so all layers share one graph."""

    def fused_mlp(x, gu_w, gu_b, gu_packed, down_w, down_b, down_packed, intermediate, hidden):
        # x: [..., H] -> gate_up: [..., 2I]
        gate_up = _project(x, gu_w, gu_b, gu_packed, 2 * intermediate)
        gate, up = gate_up.split(intermediate, dim=-1)  # each [..., I]
        return _project(act(gate) * up, down_w, down_b, down_packed, hidden)  # [..., H]

    return fused_mlp


class _CompiledMLP:
    """Calls the shared compiled function with one layer's weights."""

    def __init__(self, fn: Callable[..., torch.Tensor], mlp: FusedGatedMLP) -> None:
        self.fn, self.mlp = fn, mlp

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        return None  # a deep copy of a model runs its MLPs eagerly (compiled functions are not copied)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        gu = _projection_args(mlp.gate_up_proj)
        down = _projection_args(mlp.down_proj)
        return self.fn(x, *gu, *down, mlp.intermediate_size, mlp.down_proj.out_features)


def _settings(act: nn.Module) -> tuple[type, dict[str, Any]]:
    """An activation module's type and public attributes (e.g. GELU's ``approximate``)."""
    return type(act), {k: v for k, v in vars(act).items() if not k.startswith("_")}


def _same_activation(mlps: list[FusedGatedMLP]) -> nn.Module | None:
    """The first layer's activation if every layer's behaves identically, else ``None``."""
    first = _settings(mlps[0].act_fn)
    return mlps[0].act_fn if all(_settings(m.act_fn) == first for m in mlps[1:]) else None


def _compile_mlps(parts: ModelParts, config: CompileConfig, recorder: Recorder) -> None:
    mlps = [m for m in (get_attr_path(layer.layer, parts.spec.mlp) for layer in parts) if isinstance(m, FusedGatedMLP)]
    if not mlps:
        recorder.note(FEATURE, "MLPs not compiled (not fused: turn on fused_mlp)")
        return
    act = _same_activation(mlps)
    if act is None:
        recorder.note(FEATURE, "MLPs not compiled (layers use different activations)")
        return
    fn = torch.compile(_make_mlp_fn(act), **config.compile_kwargs())
    for mlp in mlps:
        recorder.call(
            FEATURE, "fused MLP compiled (decode shapes)", lambda m=mlp: m.set_compiled(_CompiledMLP(fn, m)),
            lambda m=mlp: m.set_compiled(None),
        )  # fmt: skip


def apply_compile(model: nn.Module, parts: ModelParts, config: CompileConfig, recorder: Recorder) -> None:
    """Pack the linears and compile the fused MLPs as ``config`` says (recorded; nothing compiles yet)."""
    define_compiled_op()
    if config.prepack:
        _prepack(model, parts, recorder)
    compile_mlps = config.mlp
    if compile_mlps is None:
        compile_mlps = device_of(model).type != "cpu"
        if not compile_mlps:
            recorder.note(FEATURE, "MLPs not compiled (CPU default: slower than packed eager; mlp=True forces it)")
    if compile_mlps:
        _compile_mlps(parts, config, recorder)
    if config.decode_step:
        _compile_paged_decode(model, parts, config, recorder)


def _compile_paged_decode(model: nn.Module, parts: ModelParts, config: CompileConfig, recorder: Recorder) -> None:
    """Bind the compiled paged decode step as ``model.forward`` (when paged attention is on, on one device)."""
    if not uses_paged_attention(model):
        recorder.note(FEATURE, "paged decode step not compiled (paged attention is off)")
        return
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or any(is_sharded(p) for p in model.parameters()) or hasattr(model, "_hf_hook"):
        recorder.note(FEATURE, "paged decode step not compiled (the model is dispatched over devices or sharded)")
        return
    define_paged_op()
    layers = [(p.layer, p.attention, p.index, p.experts is not None) for p in parts]
    slots = layer_slots(model, layers) if config.regional else ()
    step = CompiledPagedDecode(model, config, slots)
    note = "paged decode step compiled (one-token steps and verification chunks)"
    recorder.set_instance_attr(FEATURE, model, "forward", step, note)
    for slot in slots:  # regional: each layer runs its kind's compiled forward inside a decode step
        recorder.set_instance_attr(FEATURE, slot.layer, "forward", RegionalLayer(step, slot), "decoder layer: "
                                   "compiled by region inside paged decode steps")  # fmt: skip
    variant = step.variant(devices.pop().type)  # the device it is on now; another device gets its own step
    if variant.layers:
        kinds = len(variant.layers)
        recorder.note(FEATURE, f"paged decode step compiled by region: {len(slots)} decoder layers share {kinds} "
                               f"compiled layer step{'s' if kinds > 1 else ''} (embedding, final norm and LM head "
                               "eager)")  # fmt: skip
    if variant.static_shapes:
        graphs = "captured in CUDA graphs" if variant.graphs else "no CUDA graphs here"
        recorder.note(FEATURE, f"paged decode step padded to bucketed shapes ({graphs}, mode "
                               f"{config.compile_kwargs(graphs=variant.graphs).get('mode')})")  # fmt: skip


def plain_compile(copy: nn.Module) -> None:
    """A plain copy of a compile-patched model: plain ``nn.Linear`` weights again (a copy may be re-typed or
    quantized) and eager MLPs; its ``forward`` is the class's (the compiled step is never copied)."""
    unpack_linears(copy)
    for module in copy.modules():
        if isinstance(module, FusedGatedMLP):
            module.set_compiled(None)


def bind_compile(model: nn.Module, state: PatchState, config: CompileConfig) -> None:
    """Keep the compiled paged step's gate in the patch state (for draft models' calls: :func:`model_gate`); with
    ``decode_step``, give static-cache ``generate`` calls a Transformers ``compile_config``."""
    step = vars(model).get("forward")
    if isinstance(step, CompiledPagedDecode):
        state.extras[GATE_KEY] = step.gate
    if not config.decode_step:
        return

    def hook(model: nn.Module, call: GenerateCall) -> None:
        if call.kwargs.get("cache_implementation") != "static" or "compile_config" in call.kwargs:
            return
        given = call.kwargs.get("generation_config")
        if given is not None and getattr(given, "compile_config", None) is not None:
            return  # the caller chose their own compilation
        call.kwargs["compile_config"] = _transformers_compile_config(config)

    state.call_hooks.append(hook)


def _transformers_compile_config(config: CompileConfig) -> Any:
    from transformers import CompileConfig as HFCompileConfig

    kwargs = config.compile_kwargs()
    hf = HFCompileConfig(
        fullgraph=kwargs["fullgraph"], dynamic=kwargs["dynamic"], backend=kwargs["backend"], mode=kwargs.get("mode")
    )
    hf._compile_all_devices = True  # Transformers compiles only on accelerators unless told otherwise
    return hf
