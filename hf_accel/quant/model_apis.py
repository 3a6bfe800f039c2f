"""Transformers' model-level APIs on an int8-patched model: ``tie_weights``, ``num_parameters``,
``resize_token_embeddings`` and ``save_pretrained`` are bound on the instance (recorded; ``unpatch_model`` removes
them), so tools that call them (lm-evaluation-harness's ``HFLM``, ``accelerate``) keep working or get a typed error
that says what to do. ``save_pretrained`` (native backend) writes a plain float checkpoint of the de-quantized
weights; bitsandbytes and optimum-quanto layers refuse it.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import nn

from ..core.dispatch import model_dtype
from ..core.recorder import Recorder
from .core import dequantize
from .experts import PROJECTIONS, Int8Experts
from .linear import Int8Embedding, Int8Linear

__all__ = ["bind_model_apis", "float_state_dict", "warn_lossy_unpatch"]

FEATURE = "int8"
logger = logging.getLogger("hf_accel")


def _tied_head(model: nn.Module) -> Int8Linear | None:
    """The int8 LM head the input embedding looks rows up in (a tied pair), or ``None``."""
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    return embed.head[0] if isinstance(embed, Int8Embedding) else None


def _tie_weights(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """The int8 lookup already reads the LM head's matrix (the tie is structural); other models tie as usual."""
    if _tied_head(self) is None:
        type(self).tie_weights(self, *args, **kwargs)


def _num_parameters(self: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """As the unpatched model counts: every int8 matrix (a frozen buffer) counts as the parameter it replaced."""
    count = type(self).num_parameters(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    if only_trainable:  # the int8 matrices are not trainable
        return count
    tied, seen = _tied_head(self), set()
    for module in self.modules():
        if isinstance(module, Int8Linear) and module.qweight.data_ptr() not in seen:
            seen.add(module.qweight.data_ptr())
            if not (exclude_embeddings and module is tied):  # a tied head is the embedding matrix
                count += module.qweight.numel()
        if isinstance(module, Int8Experts):
            count += sum(module.get_buffer(name).numel() for name in PROJECTIONS)
    return count


_RESIZE_REFUSAL = (
    "resize_token_embeddings cannot resize int8 embeddings / LM head (hf_accel's int8 feature): resize before "
    "patching, or hf_accel.unpatch_model(model) (exact weights back with Int8Config(keep_original=True)), resize, "
    "then patch again (a model loaded as int8 with from_pretrained(quantization_config=...): load the float "
    "checkpoint, resize, then quantize)"
)
_SAVE_REFUSAL = (
    "this model's linear layers are bitsandbytes / optimum-quanto int8 layers (hf_accel's int8 feature), which "
    "Transformers' save_pretrained / from_pretrained cannot round-trip without a quantization_config. Save with "
    "hf_accel.save_quantized(model, folder), or call hf_accel.unpatch_model(model) first to save float weights"
)


def float_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with the unpatched model's keys: each :class:`Int8Linear`'s ``qweight`` / ``scale``
    become its de-quantized ``weight`` (in the model's float dtype), a tied int8 embedding gets it too, and each
    :class:`Int8Experts`' int8 ``gate_up_proj`` / ``down_proj`` (+ ``_scale``) become the de-quantized 3-D weights."""
    state = model.state_dict()
    dtype = model_dtype(model)
    embeds = {id(m.head[0]): name for name, m in model.named_modules() if isinstance(m, Int8Embedding)}
    for name, module in model.named_modules():
        if isinstance(module, Int8Experts):
            for proj in PROJECTIONS:
                state.pop(f"{name}.{proj}_scale", None)
                state[f"{name}.{proj}"] = module.dequantized(proj, dtype)  # [E, N, K]
        if not isinstance(module, Int8Linear):
            continue
        prefix = f"{name}." if name else ""
        state.pop(f"{prefix}qweight", None)
        state.pop(f"{prefix}scale", None)
        weight = dequantize(module.quantized, dtype)  # [N, K]
        state[f"{prefix}weight"] = weight
        if id(module) in embeds:  # the same tensor: Transformers saves a tied pair once
            state[f"{embeds[id(module)]}.weight"] = weight
    return state


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """Transformers' ``save_pretrained`` with the de-quantized float weights: a checkpoint plain ``from_pretrained``
    loads as the model this one computes (int8 rounding kept). ``hf_accel.save_quantized`` writes int8."""
    if kwargs.get("state_dict") is None:
        kwargs["state_dict"] = float_state_dict(self)
        logger.warning(
            "hf_accel: save_pretrained of an int8-patched model writes its de-quantized float weights (a plain "
            "checkpoint; int8 rounding kept). For an int8 checkpoint use hf_accel.save_quantized(model, folder); for "
            "the original weights, unpatch a model patched with Int8Config(keep_original=True) first"
        )
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)


def bind_model_apis(model: nn.Module, recorder: Recorder, backend: str, save: bool = True) -> None:
    """Bind the int8-aware model APIs on ``model`` (recorded). ``save_pretrained`` as such would write
    ``qweight`` / ``scale`` entries that ``from_pretrained`` drops (the linears then load randomly initialised);
    ``save=False`` leaves it alone (a model loaded through hf_accel's quantizer, which saves int8 with its
    ``quantization_config``)."""
    apis = {
        "tie_weights": (_tie_weights, "tie_weights: int8 lookup tied structurally"),
        "num_parameters": (_num_parameters, "num_parameters counts int8 matrices"),
    }
    refusals = {"resize_token_embeddings": (_RESIZE_REFUSAL, "resize_token_embeddings refused (int8 weights)")}
    if save and backend == "native":
        apis["save_pretrained"] = (_save_pretrained, "save_pretrained writes de-quantized weights")
    elif save:
        refusals["save_pretrained"] = (_SAVE_REFUSAL, f"save_pretrained refused ({backend} int8)")
    for name, (fn, what) in apis.items():
        if callable(getattr(type(model), name, None)):
            recorder.set_instance_attr(FEATURE, model, name, types.MethodType(fn, model), what)
    for name, (message, what) in refusals.items():
        if callable(getattr(type(model), name, None)):
            recorder.refuse_method(FEATURE, model, name, message, what)


def warn_lossy_unpatch(recorder: Recorder, keep_original: bool) -> None:
    """Record (first, so it runs last on undo) a warning that ``unpatch_model`` brings back de-quantized weights."""

    def warn() -> None:
        logger.warning(
            "hf_accel: unpatch_model restored int8-quantized linears with de-quantized weights (within half a "
            "quantization step of the originals, not bitwise); patch with Int8Config(keep_original=True) to get the "
            "exact originals back"
        )

    recorder.call(FEATURE, "de-quantized weights on unpatch", lambda: None, lambda: None if keep_original else warn())
