"""``patch_model`` / ``unpatch_model``: the one entry point every feature plugs into.

A patch walks the architecture spec (:mod:`hf_accel.core.registry`), applies each enabled feature through a
:class:`~hf_accel.core.recorder.Recorder`, and binds a ``generate`` wrapper on the instance. Nothing is ever
assigned to a Transformers class. ``unpatch_model`` replays the recorder backwards.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from .compile.apply import apply_compile, bind_compile, plain_compile
from .core.config import AccelConfig, FusedMLPConfig, Int8Config, NativeConfig, PagedConfig, SpeculativeConfig
from .core.dispatch import model_dtype
from .core.errors import AlreadyPatchedError, FeatureNotAvailableError, IncompatibleOptionsError, NotPatchedError
from .core.recorder import Recorder
from .core.registry import ModelParts, decoder_linears, get_spec, resolve
from .core.state import STATE_ATTR, Feature, PatchState, get_state
from .engine.apply import bind_generate_many
from .fused.apply import apply_fused_mlp, bind_fused_mlp
from .generate import bind_generate
from .native.apply import apply_native, executor_declines, native_unavailable
from .native.half import HALF_DTYPES
from .paged.apply import apply_paged, bind_paged, plain_paged
from .quant.apply import apply_int8, record_int8_experts
from .quant.bnb import is_bnb_linear
from .quant.experts import Int8Experts, check_layout
from .quant.linear import Int8Linear
from .quant.quanto import is_quanto_linear
from .speculative.apply import apply_speculative, bind_speculative

__all__ = ["FEATURES", "default_config", "is_patched", "patch_model", "patch_report", "unpatch_model"]

logger = logging.getLogger(__name__)


def _apply_paged(model: nn.Module, parts: ModelParts, cfg: PagedConfig, recorder: Recorder) -> None:
    apply_paged(model, parts, cfg, recorder)
    bind_generate_many(model, recorder)  # continuous batching runs on the paged pool


#: Feature name -> implementation. Order of application follows ``core.config.FEATURE_CONFIGS``.
FEATURES: dict[str, Feature] = {
    "int8": Feature(apply_int8, lossless=False),
    "fused_mlp": Feature(apply_fused_mlp, lossless=True, bind=bind_fused_mlp),
    "paged": Feature(_apply_paged, lossless=True, bind=bind_paged, plain=plain_paged),
    "speculative": Feature(apply_speculative, lossless=True, bind=bind_speculative),
    "compile": Feature(apply_compile, lossless=True, bind=bind_compile, plain=plain_compile),
    "native": Feature(apply_native, lossless=True),  # greedy-equal at near-ties in the tests; opt-in all the same
}


def default_config(model: nn.Module | None = None) -> AccelConfig:
    """The config ``patch_model(model)`` uses: every implemented lossless feature that pays on ``model``'s device.

    Everywhere: fused MLPs, and the paged cache and speculation on request per ``generate`` call. On the CPU, for a
    model the native executor serves (the Llama family in float32), also the executor (``native``) and automatic
    self-speculation of greedy calls (``SpeculativeConfig(auto="self")``: an int8 copy drafts, the model verifies,
    the output is the model's own greedy output), measured 2.4-2.9x the unpatched model's decode on SmolLM2-135M
    (docs/log/2026-12-06-defaults.md); the executor alone 1.56x. bfloat16 / float16 models keep the keyword-only
    default: ``native=True`` runs them through the executor with float32 activations (Llama family; 2.7x the unpatched
    bf16 SmolLM2, docs/native.md) or their decode rows through ``half_linear`` (other architectures), but the half
    model's own forward rounds after every operator, so against it greedy tokens can flip at near-ties; with int8
    weights (``int8=``, or loaded quantized), already lossy, they get the executor too (2.7x int8 alone). Elsewhere
    (CUDA) the keyword-only defaults stay until they are measured there. Without ``model``: the device-independent
    part.
    """
    return _device_default(model)[0]


def _device_default(model: nn.Module | None) -> tuple[AccelConfig, str | None]:
    """:func:`default_config`, and why the CPU default does not apply (``None``: it does)."""
    base = AccelConfig(fused_mlp=FusedMLPConfig(), paged=PagedConfig(), speculative=SpeculativeConfig())
    why = "no model to look at" if model is None else _cpu_refusal(model)
    if why is not None:
        return base, why
    auto = "self" if _float_linears(model) else None
    native = NativeConfig(half_precision=False)  # lossless only: a later cast to half hands the forward back
    return dataclasses.replace(base, native=native, speculative=SpeculativeConfig(auto=auto)), None


def _cpu_refusal(model: nn.Module) -> str | None:
    """Why the CPU default (native executor + automatic self-speculation) does not apply to ``model``."""
    weight = next(model.parameters())
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type} (the CPU default is measured on the CPU only)"
    if model_dtype(model) in HALF_DTYPES:
        return "half-precision weights: the executor's float32 sums round differently from the model (native=True)"
    why = native_unavailable(model)
    return None if why is None else f"the native executor cannot serve it: {why}"


def _float_linears(model: nn.Module) -> bool:
    """Whether the decoder's linears are float ``nn.Linear`` (not int8 already: then an int8 draft saves nothing)."""
    quantized = any(isinstance(m, (Int8Linear, Int8Experts)) or is_bnb_linear(m) or is_quanto_linear(m)
                    for m in model.modules())  # fmt: skip
    return not quantized and bool(decoder_linears(model, get_spec(model)))


def _int8_half_native(model: nn.Module, overrides: dict[str, Any]) -> bool:
    """Whether the default turns the executor on for a half-precision CPU model with hf_accel int8 weights (``int8=``
    asked, or loaded quantized) and no ``native=`` / ``compile=`` choice: int8 weights already part from the half
    model, and the executor runs them 2.7x faster than int8 alone (SmolLM2 bf16, docs/log/2026-12-07-int8-half.md)."""
    if "native" in overrides or overrides.get("compile") not in (None, False):
        return False
    int8 = overrides.get("int8")
    asked = int8 is True or (isinstance(int8, Int8Config) and int8.backend in ("auto", "native"))
    loaded = int8 in (None, False) and any(isinstance(m, Int8Linear) for m in model.modules())
    weight = next(model.parameters())
    if not (asked or loaded) or weight.device.type != "cpu" or model_dtype(model) not in HALF_DTYPES:
        return False
    return executor_declines(model) is None


def _default_for(model: nn.Module, overrides: dict[str, Any], recorder: Recorder) -> AccelConfig:
    """``default_config(model)`` adjusted to the overrides (an int8 model drafts for itself: no automatic
    self-speculation; ``compile=`` packs the weights: no executor), with the choice recorded for ``patch_report``."""
    config, why = _device_default(model)  # the executor is looked at once here (building it is the costly part)
    notes = []
    if config.speculative.auto is not None and any(overrides.get(n) not in (None, False) for n in ("int8", "compile")):
        config = dataclasses.replace(config, speculative=SpeculativeConfig())
        notes.append("int8= / compile= asked for: no automatic self-speculation (int8 weights would draft for "
                     "themselves; compile= wants its compiled steps)")  # fmt: skip
    if config.native is None and _int8_half_native(model, overrides):
        config = dataclasses.replace(config, native=NativeConfig())
        why = ("int8 weights on a half-precision model: the native executor runs them (float32 sums, which part from "
               "the half model no more than the int8 weights do); no automatic self-speculation")  # fmt: skip
    if config.native is not None and overrides.get("compile") not in (None, False) and "native" not in overrides:
        config = dataclasses.replace(config, native=None)  # the executor cannot read pre-packed weights
        notes.append("compile= packs the weights, which the executor does not read (pass native=True too for it)")
    why = why or ("; ".join(notes) if notes else None)
    parts = ["native executor"] if config.native is not None else []
    parts += ["automatic self-speculation of greedy calls"] if config.speculative.auto is not None else []
    uses = " + ".join(parts) or "keyword-only features"
    recorder.choose("default", "configuration", uses, "the fastest lossless configuration measured on this device",
                    {} if why is None else {"native executor + automatic self-speculation": why})  # fmt: skip
    return config


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` currently carries an hf_accel patch."""
    return get_state(model) is not None


def _check_available(config: AccelConfig) -> None:
    for name in config.enabled():
        if FEATURES[name].apply is None:
            raise FeatureNotAvailableError(
                f"feature {name!r} is not implemented in this version of hf_accel; "
                f"available features: {', '.join(n for n, f in FEATURES.items() if f.apply is not None)}"
            )


def patch_model(model: nn.Module, config: AccelConfig | None = None, **feature_overrides: Any) -> nn.Module:
    """Patch a Transformers causal LM instance in place.

    Args:
        model: a ``*ForCausalLM`` model whose ``config.model_type`` is in the registry.
        config: the features to turn on; default: :func:`default_config` for this model (the fastest lossless
            configuration measured on its device).
        **feature_overrides: per-feature switches applied on top of ``config``: ``paged=``, ``speculative=``,
            ``fused_mlp=``, ``compile=``, ``int8=``; each ``True``/``False`` or that feature's config object.

    Returns:
        The same ``model`` object, patched.

    Raises:
        UnsupportedModelError: not a causal LM or an unsupported architecture.
        AlreadyPatchedError: the model is already patched.
        IncompatibleOptionsError: unknown feature name or a config of the wrong type.
        FeatureNotAvailableError: a requested feature is not implemented here.

    Side effects:
        Replaces submodules / binds methods on this instance only; ``unpatch_model`` reverses all of it.
    """
    if is_patched(model):
        raise AlreadyPatchedError(
            f"{type(model).__name__} is already patched by hf_accel; call hf_accel.unpatch_model(model) first"
        )
    if config is not None and not isinstance(config, AccelConfig):
        raise IncompatibleOptionsError(f"config must be an AccelConfig or None, got {type(config).__name__}")
    recorder = Recorder()
    parts = resolve(model)  # an unsupported model: its typed error before anything looks at it
    config = (config or _default_for(model, feature_overrides, recorder)).with_overrides(**feature_overrides)
    _check_available(config)
    state = PatchState(config=config, model_type=parts.spec.model_type, recorder=recorder, features=FEATURES)
    _choose_experts(model, parts, recorder)
    try:
        for name in config.enabled():
            feature = FEATURES[name]
            feature.apply(model, parts, getattr(config, name), recorder)
            if feature.bind is not None:
                feature.bind(model, state, getattr(config, name))
        bind_generate(model, state, recorder)
        recorder.set_instance_attr("core", model, STATE_ATTR, state, "patch state attached")
    except BaseException:
        recorder.undo()
        raise
    logger.info("hf_accel: patched %s with %s", type(model).__name__, ", ".join(config.enabled()) or "no features")
    return model


def _choose_experts(model: nn.Module, parts: ModelParts, recorder: Recorder) -> None:
    """Say in ``patch_report`` what runs a mixture of experts' MoE layers: Transformers' experts implementation."""
    if not parts.moe_layers:
        return
    loaded = next((layer.experts for layer in parts if isinstance(layer.experts, Int8Experts)), None)
    if loaded is not None:  # a model loaded int8 (from_pretrained(quantization_config=Int8Config()), load_quantized)
        record_int8_experts(recorder, loaded.choices["down_proj"].impl, "loaded int8")
        return
    impl = getattr(model.config, "_experts_implementation", None) or "eager"
    try:
        check_layout(next(layer.experts for layer in parts if layer.experts is not None))
        int8 = "runs with int8= (the int8 feature swaps the experts too)"
    except TypeError as err:
        int8 = f"int8= leaves these experts in float: {err}"
    recorder.choose(
        "moe",
        "experts",
        f"Transformers' {impl!r} experts implementation (at patch time; model.set_experts_implementation changes it)",
        f"{len(parts.moe_layers)} MoE layers in float: hf_accel's features run around them",
        {"fused gated MLP": "experts are 3-D parameters picked per token, not gate / up linears",
         "hf_accel Int8Experts": int8},
    )  # fmt: skip


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the original modules, parameters and methods come back.

    Returns:
        The same ``model`` object; its logits are bitwise identical to before the patch.

    Raises:
        NotPatchedError: the model is not patched.
    """
    state = get_state(model)
    if state is None:
        raise NotPatchedError(f"{type(model).__name__} is not patched by hf_accel; nothing to unpatch")
    state.recorder.undo()
    return model


def patch_report(model: nn.Module) -> dict[str, Any]:
    """Describe the patch on ``model``.

    Returns:
        ``{"model_type": str, "features": {name: config as dict}, "changes": {feature: {change: count}},
        "implementations": {feature: {what: {"uses": name, "why": reason, "not": {other: why not}}}},
        "generate_kwargs": [names]}``.

    Raises:
        NotPatchedError: the model is not patched.
    """
    state = get_state(model)
    if state is None:
        raise NotPatchedError(f"{type(model).__name__} is not patched by hf_accel; there is no report")
    return {
        "model_type": state.model_type,
        "features": {n: dataclasses.asdict(getattr(state.config, n)) for n in state.config.enabled()},
        "changes": state.recorder.counts(),
        "implementations": {f: {w: dict(c) for w, c in per.items()} for f, per in state.recorder.choices.items()},
        "generate_kwargs": sorted(state.generate_kwargs),
    }


def last_stats(model: nn.Module) -> Any:
    """The :class:`~hf_accel.core.metrics.GenerationStats` of the last ``generate`` call on ``model`` (``None`` before
    the first call).

    Raises:
        NotPatchedError: the model is not patched.
    """
    state = get_state(model)
    if state is None:
        raise NotPatchedError(f"{type(model).__name__} is not patched by hf_accel; it keeps no stats")
    return state.extras.get("last_stats")
