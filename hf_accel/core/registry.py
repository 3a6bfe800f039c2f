"""Supported architectures, as data.

Each :class:`ArchSpec` says where one ``model_type`` keeps its decoder layers and, inside a layer, its
attention, MLP and projections. :func:`resolve` checks a model against its spec and returns the located
modules; every feature walks that result instead of knowing architecture names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import UnsupportedModelError
from .versions import require_supported_versions

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "LayerParts",
    "ModelParts",
    "decoder_linears",
    "experts_modules",
    "get_spec",
    "named_experts",
    "resolve",
    "rope_entries",
    "supported_model_types",
]


@dataclass(frozen=True)
class ArchSpec:
    """Where one architecture keeps its parts. Paths are dotted attribute paths.

    Args:
        model_type: ``config.model_type`` this spec applies to.
        layers: path from the ``*ForCausalLM`` model to the ``nn.ModuleList`` of decoder layers.
        attention: path from a decoder layer to its attention module.
        mlp: path from a decoder layer to its MLP module.
        qkv_proj: paths from the attention module to its query/key/value projections (one if fused).
        o_proj: path from the attention module to its output projection.
        gate_proj, up_proj: paths from the MLP to its separate gate / up projections (``None`` if fused).
        gate_up_proj: path from the MLP to an already-fused ``[gate; up]`` projection (e.g. Phi-3).
        down_proj: path from the MLP to its down projection.
        act_fn: path from the MLP to its activation module.
        act_config_keys: config attributes naming the MLP activation, first one present wins.
        lm_head: path from the model to the output projection.
        embed_tokens: path from the model to the input embedding.
        experts: path from the MLP to its experts module (Transformers' 3-D ``gate_up_proj`` / ``down_proj``
            parameters) on mixture-of-experts layers; ``None`` for dense-only architectures. A layer whose MLP has it
            is a MoE layer: its router and experts are not checked against the dense projection paths.
        router: path from a MoE layer's MLP to its router. Its linears stay as they are (never quantized, packed
            or swapped): the router's scores pick the experts, and some routers read their linear's weight directly.
    """

    model_type: str
    layers: str = "model.layers"
    attention: str = "self_attn"
    mlp: str = "mlp"
    qkv_proj: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    o_proj: str = "o_proj"
    gate_proj: str | None = "gate_proj"
    up_proj: str | None = "up_proj"
    gate_up_proj: str | None = None
    down_proj: str = "down_proj"
    act_fn: str = "act_fn"
    act_config_keys: tuple[str, ...] = ("hidden_act",)
    lm_head: str = "lm_head"
    embed_tokens: str = "model.embed_tokens"
    experts: str | None = None
    router: str = "gate"


_GEMMA_ACT = ("hidden_activation", "hidden_act")
#: mixture-of-experts architectures with Llama's attention whose router is ``mlp.gate``
_MOE_GATE = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "flex_olmo",
    "glm4_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "cohere2_moe",
    "exaone_moe",
    "minimax_m2",  # q/k norms over all heads, partial rotary embedding
    "solar_open",  # grouped top-k routing, shared experts
    "laguna",  # per-layer query heads, gated attention output, sliding and full layers
    "mellum",  # per-head q/k norms, sliding and full layers
    "hy_v3",  # a dense first layer, shared experts
)

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama"),
        ArchSpec("mistral"),
        ArchSpec("qwen2"),
        ArchSpec("qwen3"),
        ArchSpec("gemma", act_config_keys=_GEMMA_ACT),
        ArchSpec("gemma2", act_config_keys=_GEMMA_ACT),
        ArchSpec("gemma3_text", act_config_keys=_GEMMA_ACT),
        ArchSpec(
            "phi3",
            qkv_proj=("qkv_proj",),
            gate_proj=None,
            up_proj=None,
            gate_up_proj="gate_up_proj",
            act_fn="activation_fn",
        ),
        ArchSpec("olmo2"),
        ArchSpec("granite"),
        ArchSpec("smollm3"),
        ArchSpec("ministral"),
        ArchSpec("olmo3"),
        ArchSpec("cohere2"),
        ArchSpec("exaone4"),
        ArchSpec("ernie4_5"),
        ArchSpec("ministral3"),
        ArchSpec("cohere"),
        ArchSpec("exaone"),
        ArchSpec(
            "glm",
            gate_proj=None,
            up_proj=None,
            gate_up_proj="gate_up_proj",
            act_fn="activation_fn",
        ),
        # mixtures of experts: Transformers' experts implementation runs the MoE layers, hf_accel the rest
        *(ArchSpec(mt, experts="experts") for mt in _MOE_GATE),
        ArchSpec("phimoe", experts="experts", router="router"),
        # attention sinks (s_aux) in every layer; experts stored [E, in, out] with biases (kept float by int8)
        ArchSpec("gpt_oss", experts="experts", router="router"),
        *(
            ArchSpec(mt, mlp="block_sparse_moe", experts="experts", router="router")
            # granitemoe_swa: sliding and full layers with attention sinks; granitemoeshared: a shared MLP
            for mt in ("granitemoe", "granitemoeshared", "granitemoe_swa")
        ),
        ArchSpec(
            "glm4",
            gate_proj=None,
            up_proj=None,
            gate_up_proj="gate_up_proj",
            act_fn="activation_fn",
        ),
    )
}


def rope_entries(config: Any) -> list[dict[str, Any]]:
    """The rotary embedding parameters of ``config``: ``rope_parameters`` (or the older ``rope_scaling``), one dict
    with a ``rope_type`` (or the older ``type``), or one dict per layer type; empty without rotary parameters."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if "rope_type" in params or "type" in params:
        return [params]
    return [v for v in params.values() if isinstance(v, dict)]


def supported_model_types() -> list[str]:
    """Sorted list of the ``model_type`` values hf_accel can patch."""
    return sorted(ARCHITECTURES)


@dataclass(frozen=True)
class LayerParts:
    """The located modules of one decoder layer (attribute paths are relative to the model)."""

    index: int
    path: str
    layer: nn.Module
    attention: nn.Module
    attention_path: str
    mlp: nn.Module
    mlp_path: str
    activation: str
    #: the experts module of a mixture-of-experts layer (``None``: a dense MLP)
    experts: nn.Module | None = None


@dataclass(frozen=True)
class ModelParts:
    """A model checked against its :class:`ArchSpec`."""

    spec: ArchSpec
    layers: tuple[LayerParts, ...]

    def __iter__(self) -> Iterator[LayerParts]:
        return iter(self.layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP is a mixture of experts."""
        return tuple(layer.index for layer in self.layers if layer.experts is not None)


def get_attr_path(root: nn.Module, path: str) -> nn.Module:
    """Follow a dotted attribute path (integers index ``ModuleList``s)."""
    obj = root
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def decoder_linears(model: nn.Module, spec: ArchSpec) -> list[tuple[str, nn.Linear]]:
    """``(name, module)`` of every plain ``nn.Linear`` inside the decoder layers (a fused MLP's ``gate_up_proj``
    included), plus the LM head; none inside an adapter-wrapped projection (PEFT's layers keep a ``base_layer`` and
    read their own linears' weights, so swapping or packing them would break the adapter), none inside a MoE
    layer's router (``spec.router``)."""
    prefix, head = f"{spec.layers}.", spec.lm_head
    modules = list(model.named_modules())
    wrapped = {name for name, module in modules if isinstance(getattr(module, "base_layer", None), nn.Module)}
    kept = wrapped | _routers(model, spec)
    return [
        (name, module)
        for name, module in modules
        if type(module) is nn.Linear
        and (name.startswith(prefix) or name == head)
        and name not in kept
        and not _inside(name, kept)
    ]


def named_experts(model: nn.Module, spec: ArchSpec) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the experts module of every mixture-of-experts layer of ``model``
    (``model.layers.1.mlp.experts``: Transformers' float experts, or the ``Int8Experts`` the int8 feature or an int8
    load put there); empty for a dense architecture."""
    if spec.experts is None:
        return []
    found = []
    for index, layer in enumerate(get_attr_path(model, spec.layers)):
        experts = _experts(get_attr_path(layer, spec.mlp), spec)
        if experts is not None:
            found.append((f"{spec.layers}.{index}.{spec.mlp}.{spec.experts}", experts))
    return found


def experts_modules(model: nn.Module, spec: ArchSpec) -> list[nn.Module]:
    """The experts module of every mixture-of-experts layer of ``model`` (:func:`named_experts` without the names)."""
    return [experts for _, experts in named_experts(model, spec)]


def _routers(model: nn.Module, spec: ArchSpec) -> set[str]:
    """Module names of the MoE routers (``model.layers.3.mlp.gate``; HunYuan's reads ``gate.wg.weight`` itself)."""
    if spec.experts is None:
        return set()
    layers = get_attr_path(model, spec.layers)
    return {f"{spec.layers}.{i}.{spec.mlp}.{spec.router}" for i in range(len(layers))}


def _inside(name: str, wrapped: set[str]) -> bool:
    """Whether module ``name`` lies inside one of the ``wrapped`` modules."""
    if not wrapped:
        return False
    parts = name.split(".")
    return any(".".join(parts[:i]) in wrapped for i in range(1, len(parts)))


def parent_and_name(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """Split a dotted path into (the module holding the last attribute, that attribute's name)."""
    head, _, name = path.rpartition(".")
    return (get_attr_path(root, head) if head else root), name


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def _check_causal_lm(model: nn.Module) -> None:
    from transformers import GenerationMixin, PreTrainedModel

    name = type(model).__name__
    inner = getattr(model, "get_base_model", None)
    if name.startswith("Peft") and callable(inner):  # a PEFT wrapper around a causal LM
        raise UnsupportedModelError(
            _model_type(model),
            ARCHITECTURES,
            reason=f"{name} is PEFT's wrapper: patch the causal LM inside it, hf_accel.patch_model(model."
            "get_base_model()), and keep calling model.generate (adapter-wrapped projections run their own forward "
            "there, so features that would bypass them leave those layers alone); for full speed merge the adapter "
            "first, model = model.merge_and_unload()",
        )
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise UnsupportedModelError(
            _model_type(model),
            ARCHITECTURES,
            reason=f"{name} is not a Transformers causal language model (a PreTrainedModel with generate())",
        )
    if name not in _causal_lm_class_names():
        raise UnsupportedModelError(
            _model_type(model),
            ARCHITECTURES,
            reason=f"{name} is not a causal LM class (it is not in AutoModelForCausalLM's mapping); "
            "load the model with AutoModelForCausalLM",
        )


def _causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def get_spec(model: nn.Module) -> ArchSpec:
    """Return the registry entry for ``model`` or raise :class:`UnsupportedModelError`."""
    _check_causal_lm(model)
    model_type = _model_type(model)
    spec = ARCHITECTURES.get(model_type)
    if spec is None:
        raise UnsupportedModelError(model_type, ARCHITECTURES)
    return spec


def _find(root: nn.Module, path: str, where: str, spec: ArchSpec) -> nn.Module:
    try:
        return get_attr_path(root, path)
    except (AttributeError, IndexError) as err:
        raise UnsupportedModelError(
            spec.model_type,
            ARCHITECTURES,
            reason=f"model_type {spec.model_type!r} does not match hf_accel's spec: {where}.{path} is missing",
        ) from err


def _activation(model: nn.Module, spec: ArchSpec) -> str:
    for key in spec.act_config_keys:
        value = getattr(model.config, key, None)
        if isinstance(value, str):
            return value
    raise UnsupportedModelError(
        spec.model_type,
        ARCHITECTURES,
        reason=f"config has none of {spec.act_config_keys} naming the MLP activation",
    )


def _experts(mlp: nn.Module, spec: ArchSpec) -> nn.Module | None:
    """The experts module of a MoE layer's ``mlp``, or ``None`` for a dense MLP."""
    if spec.experts is None:
        return None
    try:
        experts = get_attr_path(mlp, spec.experts)
    except AttributeError:
        return None  # a dense layer of a MoE model (Qwen3-MoE's ``mlp_only_layers``, GLM-4.5's first layers)
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise UnsupportedModelError(
                spec.model_type,
                ARCHITECTURES,
                reason=f"{type(experts).__name__}.{name} is not a 3-D [experts, out, in] weight",
            )
    return experts


def resolve(model: nn.Module) -> ModelParts:
    """Check ``model`` against its spec and locate every layer's attention and MLP.

    Raises:
        UnsupportedVersionError: PyTorch or Transformers is older than hf_accel needs (every entry point resolves its
            model first, so this is where they all check).
        UnsupportedModelError: not a causal LM, unknown ``model_type``, or a module the spec names is missing.
    """
    require_supported_versions()
    spec = get_spec(model)
    layers = _find(model, spec.layers, type(model).__name__, spec)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedModelError(
            spec.model_type,
            ARCHITECTURES,
            reason=f"{spec.layers} is {type(layers).__name__}, not a ModuleList",
        )
    activation = _activation(model, spec)
    mlp_proj = [p for p in (spec.gate_proj, spec.up_proj, spec.gate_up_proj, spec.down_proj, spec.act_fn) if p]
    attn_proj = (*spec.qkv_proj, spec.o_proj)
    parts = []
    for i, layer in enumerate(layers):
        path = f"{spec.layers}.{i}"
        attention = _find(layer, spec.attention, path, spec)
        mlp = _find(layer, spec.mlp, path, spec)
        for proj in attn_proj:
            _find(attention, proj, f"{path}.{spec.attention}", spec)
        experts = _experts(mlp, spec)
        for proj in mlp_proj if experts is None else ():
            _find(mlp, proj, f"{path}.{spec.mlp}", spec)
        attention_path, mlp_path = f"{path}.{spec.attention}", f"{path}.{spec.mlp}"
        parts.append(LayerParts(i, path, layer, attention, attention_path, mlp, mlp_path, activation, experts))
    return ModelParts(spec, tuple(parts))
