"""Adapter: swap a model's linears (decoder layers + LM head) for :class:`Int8Linear`, recorded."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn

from ..config import Int8Config
from ..errors import FeatureNotAvailableError, IncompatibleOptionsError
from ..recorder import Recorder
from ..registry import ModelParts, get_attr_path, parent_and_name
from .core import dequantize
from .linear import Int8Embedding, Int8Linear

__all__ = ["apply_int8"]

logger = logging.getLogger(__name__)
FEATURE = "int8"


def _targets(model: nn.Module, parts: ModelParts, config: Int8Config) -> list[tuple[str, nn.Linear]]:
    names = [f"{parts.spec.layers}.", parts.spec.lm_head]
    out = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not (name.startswith(names[0]) or name == names[1]):
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.skip_modules):
            continue
        out.append((name, module))
    return out


def _check(model: nn.Module, config: Int8Config) -> None:
    if config.backend == "bitsandbytes":
        raise FeatureNotAvailableError("the bitsandbytes int8 backend is not implemented yet; use backend='native'")
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise IncompatibleOptionsError("the model already holds Int8Linear layers; it is quantized already")
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise IncompatibleOptionsError(f"int8 quantization needs float32/float16/bfloat16 weights, got {dtype}")


def _swap(recorder: Recorder, model: nn.Module, name: str, linear: nn.Linear, new: nn.Module, keep: bool) -> None:
    parent, attr = parent_and_name(model, name)
    recorder.set_submodule(FEATURE, parent, attr, new, "Linear -> Int8Linear")
    weight = linear.weight
    dtype, device = weight.dtype, weight.device
    original = weight.data if keep else None  # only a kept weight may stay referenced: the rest must be freed

    def free() -> None:
        weight.data = torch.empty(0, dtype=dtype, device=device)

    def restore() -> None:
        weight.data = original if original is not None else dequantize(new.quantized, dtype)

    recorder.call(FEATURE, "float weight released" if not keep else "float weight kept", free, restore)


def apply_int8(model: nn.Module, parts: ModelParts, config: Int8Config, recorder: Recorder) -> None:
    """Quantize every ``nn.Linear`` of the decoder layers and the LM head (minus ``skip_modules``).

    Side effects:
        Linears are replaced by :class:`Int8Linear`; with tied embeddings the input embedding becomes an
        :class:`Int8Embedding` reading the same int8 matrix. Without ``keep_original`` the float weights are
        released and ``unpatch_model`` restores de-quantized values (not bitwise the originals).
    """
    _check(model, config)
    embed = get_attr_path(model, parts.spec.embed_tokens)
    head_name = parts.spec.lm_head
    tied = get_attr_path(model, head_name).weight is embed.weight
    scale = getattr(embed, "embed_scale", None)
    known_embedding = type(embed) is nn.Embedding or isinstance(scale, torch.Tensor)
    for name, linear in _targets(model, parts, config):
        if name == head_name and tied and not known_embedding:
            recorder.note(FEATURE, "tied lm_head left in float (custom embedding)")
            continue
        new = Int8Linear.from_module(linear, config.group_size).to(linear.weight.device)
        if name == head_name and tied:
            factor = None if scale is None else float(scale)
            lookup = Int8Embedding(new, embed.weight.dtype, getattr(embed, "padding_idx", None), factor)
            parent, attr = parent_and_name(model, parts.spec.embed_tokens)
            recorder.set_submodule(FEATURE, parent, attr, lookup, "tied embedding -> int8")
        _swap(recorder, model, name, linear, new, config.keep_original)
    logger.info("hf_accel: int8 %s", recorder.counts().get(FEATURE, {}))
