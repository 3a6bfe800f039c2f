"""Load int8 the Transformers way: an ``HfQuantizer`` and its quantization config, registered on request.

After :func:`register_quantizer` (never at import; :func:`unregister_quantizer` takes it back)::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=hf_accel.Int8Config())

quantizes each linear while its tensor loads (the float model is never whole in memory), and a model saved with
``save_pretrained`` writes int8 ``qweight`` / ``scale`` tensors plus ``quantization_config`` in config.json, which
``from_pretrained(saved)`` reloads as int8 with no ``quantization_config`` argument. The model holds the same
:class:`~hf_accel.quant.linear.Int8Linear` layers (and tied int8 embedding) as ``patch_model(model, int8=...)``
gives, with the same maths, so ``patch_model(model)`` adds the lossless features on top.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import auto as hf_auto
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..core.config import Int8Config
from ..core.errors import CheckpointError, IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.registry import ArchSpec, get_attr_path, named_experts, parent_and_name, resolve
from .apply import can_tie_embedding, int8_experts_kept, int8_targets, quantize_linears
from .core import QuantizedWeight, quantize
from .experts import PROJECTIONS, Int8Experts, quantize_stack
from .linear import Int8Embedding, Int8Linear
from .model_apis import bind_model_apis

__all__ = [
    "Int8HfQuantizer",
    "Int8QuantizationConfig",
    "Int8Quantize",
    "is_quantizer_registered",
    "register_quantizer",
    "unregister_quantizer",
]

logger = logging.getLogger("hf_accel")
METHOD = Int8Config.quant_method
FORMAT = 1
_LOCK = threading.Lock()


class Int8QuantizationConfig(QuantizationConfigMixin):
    """hf_accel int8 as Transformers stores it (``config.json`` -> ``quantization_config``).

    Args:
        group_size: as :class:`~hf_accel.Int8Config`.
        skip_modules: as :class:`~hf_accel.Int8Config`.
        activations: as :class:`~hf_accel.Int8Config`.
        backend: ``"native"`` (``"auto"`` means it here).
        format: the checkpoint format version (1).

    Raises:
        IncompatibleOptionsError: an option :class:`~hf_accel.Int8Config` refuses, or one with no meaning here.
        CheckpointError: a newer checkpoint format, or fields this version does not know.
    """

    def __init__(
        self,
        group_size: int | None = None,
        skip_modules: Any = (),
        activations: str = "float",
        backend: str = "native",
        format: int = FORMAT,
        **unknown: Any,
    ) -> None:
        unknown.pop("quant_method", None)
        for name in ("keep_original", "threshold"):  # Int8Config fields that mean nothing in a saved record
            unknown.pop(name, None)
        if format != FORMAT or unknown:
            raise CheckpointError(
                f"quantization_config {METHOD!r} format {format} with fields {sorted(unknown)}: this hf_accel reads "
                f"format {FORMAT}; upgrade hf_accel to load this checkpoint"
            )
        options = _check_options(Int8Config(backend, group_size, tuple(skip_modules), activations=activations))
        self.quant_method = METHOD
        self.format = FORMAT
        self.backend = "native"
        self.group_size = options.group_size
        self.skip_modules = list(options.skip_modules)
        self.activations = options.activations

    @classmethod
    def from_int8_config(cls, config: Int8Config) -> Int8QuantizationConfig:
        """The stored form of ``config`` (``keep_original=True`` refused: loading keeps no float model)."""
        _check_options(config)
        return cls(config.group_size, config.skip_modules, config.activations)

    def int8_config(self) -> Int8Config:
        """The :class:`~hf_accel.Int8Config` this record stands for."""
        return Int8Config("native", self.group_size, tuple(self.skip_modules), activations=self.activations)


def _check_options(config: Int8Config) -> Int8Config:
    if config.backend not in ("auto", "native"):
        other = "BitsAndBytesConfig(load_in_8bit=True)" if config.backend == "bitsandbytes" else "QuantoConfig('int8')"
        raise IncompatibleOptionsError(
            f"from_pretrained(quantization_config=Int8Config(backend={config.backend!r})): hf_accel's quantizer "
            f"loads its native int8 layers only; pass transformers.{other} instead (Transformers loads that backend "
            "itself; hf_accel.patch_model works on the result), or backend='native'"
        )
    if config.keep_original:
        raise IncompatibleOptionsError(
            "Int8Config(keep_original=True) has no meaning while loading (there is no float model to keep); load the "
            "float model and hf_accel.patch_model(model, int8=Int8Config(keep_original=True)) for an exact unpatch"
        )
    return config


class Int8Quantize(ConversionOps):
    """The on-the-fly step: one float ``weight`` from the checkpoint -> that layer's ``qweight`` and ``scale``."""

    def __init__(self, hf_quantizer: Int8HfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(
        self,
        input_dict: dict[str, Any],
        full_layer_name: str | None = None,
        model: nn.Module | None = None,
        missing_keys: set[str] | None = None,
        **kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        value = next(iter(input_dict.values()))
        value = value[0] if isinstance(value, list) else value  # weight: [N, K] float (experts: [E, N, K] / [E, K, N])
        prefix = full_layer_name.rpartition(".")[0]
        module = model.get_submodule(prefix)
        if isinstance(module, Int8Experts):  # gate_up_proj / down_proj: float -> int8 [E, N, K] + [E, N, G] scales
            qweight, scale = quantize_stack(value, module.transposed, self.hf_quantizer.options.group_size)
            if missing_keys is not None:
                missing_keys.discard(full_layer_name)
            return {full_layer_name: qweight, f"{full_layer_name}_scale": scale}
        qw = quantize(value, module.group_size)  # [N, K] int8 + [N, G] float32, on the tensor's device
        del module.weight  # the float placeholder: never materialised
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        return {f"{prefix}.qweight": qw.qweight, f"{prefix}.scale": qw.scale}


def _placeholder(linear: nn.Linear, options: Int8Config, with_weight: bool) -> Int8Linear:
    """An :class:`Int8Linear` on the meta device shaped for ``linear`` (plus its float ``weight`` slot when the
    checkpoint holds float weights, so the loader matches the key and hands it to :class:`Int8Quantize`)."""
    n, k = linear.out_features, linear.in_features
    size = k if options.group_size is None else options.group_size
    if k % size:
        raise IncompatibleOptionsError(f"Int8Config.group_size={options.group_size} does not divide in_features {k}")
    with torch.device("meta"):
        qw = QuantizedWeight(torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // size, dtype=torch.float32), size)
        layer = Int8Linear(qw, linear.bias, options.activations)
        if with_weight:
            layer.weight = nn.Parameter(torch.empty(n, k, dtype=linear.weight.dtype), requires_grad=False)
    return layer


class Int8HfQuantizer(HfQuantizer):
    """Transformers' side of hf_accel int8: swaps the linears of a (meta) model for :class:`Int8Linear` before
    weights load, quantizes float weights as they arrive (``pre_quantized=False``) or loads ``qweight`` / ``scale``
    as they are, and finishes the tied LM head / embedding pair after loading."""

    requires_calibration = False

    def __init__(self, quantization_config: Any, **kwargs: Any) -> None:
        if isinstance(quantization_config, Int8Config):
            quantization_config = Int8QuantizationConfig.from_int8_config(quantization_config)
        super().__init__(quantization_config, **kwargs)
        self.options = quantization_config.int8_config()

    @property
    def quantized_element_size(self) -> float | None:
        return 1.0

    def validate_environment(self, *args: Any, device_map: Any = None, **kwargs: Any) -> None:
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        if "disk" in places:
            raise IncompatibleOptionsError(
                "hf_accel int8 layers cannot be offloaded to disk; use a device_map without 'disk' (int8 needs a "
                "quarter of the float32 memory) or skip those modules with Int8Config(skip_modules=[...])"
            )

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        prefix, _, name = param_name.rpartition(".")
        module = model.get_submodule(prefix) if prefix else model
        if isinstance(module, Int8Experts):  # a float checkpoint's experts, quantized as they arrive
            return name in PROJECTIONS and not self.pre_quantized
        return isinstance(module, Int8Linear) and name == "weight" and "weight" in module._parameters

    def get_quantize_ops(self) -> ConversionOps:
        return Int8Quantize(self)

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        spec = resolve(model).spec
        tied = _tied_head(model, spec)
        options = self._options_for(model)
        for name, linear in int8_targets(model, spec, options):
            if name == spec.lm_head and tied and not self.pre_quantized:
                continue  # its weight is the embedding's: quantized once both are loaded (after loading)
            layer = _placeholder(linear, options, with_weight=not self.pre_quantized)
            parent, attr = parent_and_name(model, name)
            setattr(parent, attr, layer)
            if name == spec.lm_head and tied:  # a saved int8 pair: the lookup reads the head's int8 rows
                _tie_placeholder(model, spec, layer)
        _experts_placeholders(model, spec, options)
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        spec = resolve(model).spec
        for name, module in model.named_modules():
            if isinstance(module, Int8Linear) and "weight" in module._parameters:  # absent from the checkpoint:
                _requantize(module)  # Transformers initialised it (and said so); quantize that
            if isinstance(module, Int8Linear) and module.qweight.is_meta:
                raise CheckpointError(f"{name}: the checkpoint holds no qweight / scale for this int8 layer")
            if isinstance(module, Int8Experts):
                _check_loaded_experts(name, module)
        recorder = Recorder()  # nothing here is undone: the model is born int8, as with bitsandbytes / quanto
        quantize_linears(model, spec, self._options_for(model), recorder, "native")  # a tied head, once loaded
        bind_model_apis(model, recorder, "native", save=False)
        return model

    def _options_for(self, model: nn.Module) -> Int8Config:
        """The options plus Transformers' ``_keep_in_fp32_modules`` of this model as skipped patterns."""
        keep = [f"*{m}*" for m in (getattr(model, "_keep_in_fp32_modules", None) or ())]
        opts = self.options
        return Int8Config("native", opts.group_size, (*opts.skip_modules, *keep), activations=opts.activations)

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        raise IncompatibleOptionsError(
            "hf_accel int8 keeps no float weights to de-quantize into; load the float checkpoint instead"
        )

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _experts_placeholders(model: nn.Module, spec: ArchSpec, options: Int8Config) -> None:
    """Each MoE layer's experts (minus those ``skip_modules`` names, or stored another way) -> an
    :class:`Int8Experts` on the meta device: its int8 ``gate_up_proj`` / ``down_proj`` and ``_scale`` tensors load
    from an int8 checkpoint, or from a float one's 3-D weights quantized as they arrive."""
    for name, experts in named_experts(model, spec):
        if int8_experts_kept(name, experts, options, "native") is not None:
            continue
        try:
            placeholder = Int8Experts.placeholder(experts, options.group_size)
        except ValueError as err:
            raise IncompatibleOptionsError(
                f"{name}: {err}; choose a group_size that divides it, or Int8Config(skip_modules=[{name!r}])"
            ) from None
        parent, attr = parent_and_name(model, name)
        setattr(parent, attr, placeholder)


def _check_loaded_experts(name: str, module: Int8Experts) -> None:
    """Raise unless every int8 tensor of ``module`` loaded as int8 with its scales (and its biases, where it has
    them)."""
    for key, bias in module.named_parameters():
        if bias.is_meta:
            raise CheckpointError(f"{name}: the checkpoint holds no {key} for these experts")
    for proj in PROJECTIONS:
        weight, scale = module.get_buffer(proj), module.get_buffer(f"{proj}_scale")
        if weight.is_meta or scale.is_meta or weight.dtype != torch.int8:
            raise CheckpointError(
                f"{name}: the checkpoint holds no int8 {proj} / {proj}_scale for these int8 experts (got "
                f"{weight.dtype}{', scales missing' if scale.is_meta else ''})"
            )
    module.bind_kernel()  # the device the tensors loaded on


def _tied_head(model: nn.Module, spec: ArchSpec) -> bool:
    """Whether the LM head's weight is the input embedding's and its lookup can read int8 rows."""
    tied = f"{spec.lm_head}.weight" in (getattr(model, "all_tied_weights_keys", None) or {})
    return tied and can_tie_embedding(get_attr_path(model, spec.embed_tokens))


def _tie_placeholder(model: nn.Module, spec: ArchSpec, head: Int8Linear) -> None:
    """A saved int8 head + lookup pair: the embedding reads ``head``'s rows; Transformers ties nothing more."""
    embed = get_attr_path(model, spec.embed_tokens)
    factor = _embed_scale(embed)
    lookup = Int8Embedding(head, embed.weight.dtype, getattr(embed, "padding_idx", None), factor)
    parent, attr = parent_and_name(model, spec.embed_tokens)
    setattr(parent, attr, lookup)
    model.all_tied_weights_keys = {
        k: v for k, v in model.all_tied_weights_keys.items() if k != f"{spec.lm_head}.weight"
    }


def _embed_scale(embed: nn.Module) -> float | None:
    """The factor a scaled (Gemma-style) embedding multiplies its lookup by, as the float32 buffer holds it; on the
    meta device the buffer has no value, so it comes from the module's ``scalar_embed_scale``."""
    scale = getattr(embed, "embed_scale", None)
    if scale is None:
        return None
    if not scale.is_meta:
        return float(scale)
    scalar = getattr(embed, "scalar_embed_scale", None)
    if scalar is None:
        raise CheckpointError(f"{type(embed).__name__}: cannot read its embedding scale on the meta device")
    return float(torch.tensor(scalar, dtype=scale.dtype, device="cpu"))  # the default device is meta here


def _requantize(module: Int8Linear) -> None:
    weight = module._parameters.pop("weight")
    qw = quantize(weight.data, module.group_size)
    module.qweight, module.scale = qw.qweight, qw.scale


def is_quantizer_registered() -> bool:
    """Whether hf_accel's int8 quantizer is in Transformers' quantizer registry."""
    return hf_auto.AUTO_QUANTIZER_MAPPING.get(METHOD) is Int8HfQuantizer


def register_quantizer() -> None:
    """Register hf_accel int8 with Transformers' quantizer registry (idempotent; never done at import), so
    ``from_pretrained(path, quantization_config=hf_accel.Int8Config(...))`` quantizes while loading and int8
    checkpoints saved with ``save_pretrained`` load back. :func:`unregister_quantizer` restores the registry.

    Raises:
        IncompatibleOptionsError: another quantizer already took the name ``"hf_accel_int8"``.
    """
    with _LOCK:
        if is_quantizer_registered():
            return
        if METHOD in hf_auto.AUTO_QUANTIZER_MAPPING or METHOD in hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            raise IncompatibleOptionsError(f"Transformers' quantizer registry already has another {METHOD!r}")
        hf_auto.register_quantization_config(METHOD)(Int8QuantizationConfig)
        hf_auto.register_quantizer(METHOD)(Int8HfQuantizer)


def unregister_quantizer() -> None:
    """Take hf_accel int8 out of Transformers' quantizer registry again (a no-op when it is not there)."""
    with _LOCK:
        if is_quantizer_registered():
            del hf_auto.AUTO_QUANTIZER_MAPPING[METHOD]
            del hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD]
