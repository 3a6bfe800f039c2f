"""Quantize once, reload in seconds: int8 checkpoints as safetensors plus a small JSON record.

Layout of a checkpoint folder::

    config.json                 the model's Transformers config
    hf_accel_int8.json          format, backend, group size, skipped modules, model type, tensor names
    model.int8.safetensors      the patched model's state dict: int8 ``qweight`` + float32 ``scale`` (+ ``bias``)
                                for every quantized linear, float tensors for everything else
    (tokenizer files, when a tokenizer is passed)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .core.config import Int8Config
from .core.dispatch import model_dtype
from .core.errors import IncompatibleOptionsError, ModelNotFoundError, NotPatchedError
from .core.state import get_state
from .quant.bnb import is_bnb_linear
from .quant.linear import Int8Linear

__all__ = ["load_quantized", "save_quantized"]

FORMAT = 1
RECORD = "hf_accel_int8.json"
WEIGHTS = "model.int8.safetensors"


def save_quantized(model: nn.Module, path: str | os.PathLike[str], tokenizer: Any | None = None) -> Path:
    """Write an int8-patched model to ``path`` (a folder, created if needed).

    Args:
        model: a model patched with ``int8=`` (native backend).
        path: the folder.
        tokenizer: optionally saved alongside, so the folder is self-contained.

    Returns:
        The folder.

    Raises:
        NotPatchedError: the model is not int8-quantized by hf_accel.
    """
    from safetensors.torch import save_file

    state = get_state(model)
    cfg = getattr(state.config, "int8", None) if state is not None else None
    if cfg is not None and any(is_bnb_linear(m) for m in model.modules()):
        raise IncompatibleOptionsError(
            "save_quantized writes the native backend's format; this model holds bitsandbytes layers. "
            "Patch with Int8Config(backend='native') to save, or re-convert with bitsandbytes after loading"
        )
    if cfg is None or not any(isinstance(m, Int8Linear) for m in model.modules()):
        raise NotPatchedError(
            "save_quantized needs a model patched with int8: hf_accel.patch_model(model, int8=True) first"
        )
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": str(FORMAT)})
    model.config.save_pretrained(folder)
    record = {
        "format": FORMAT,
        "backend": "native",
        "group_size": cfg.group_size,
        "activations": cfg.activations,
        "skip_modules": list(cfg.skip_modules),
        "model_type": model.config.model_type,
        "quantized": sorted(n for n, m in model.named_modules() if isinstance(m, Int8Linear)),
        "dtype": str(model_dtype(model)).removeprefix("torch."),
    }
    (folder / RECORD).write_text(json.dumps(record, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def _read_record(folder: Path) -> dict[str, Any]:
    record_path = folder / RECORD
    if not record_path.is_file() or not (folder / WEIGHTS).is_file():
        raise ModelNotFoundError(
            f"{str(folder)!r} is not an hf_accel int8 checkpoint (no {RECORD} / {WEIGHTS}); "
            "write one with hf_accel.save_quantized(model, path)"
        )
    record = json.loads(record_path.read_text())
    if record.get("format") != FORMAT:
        raise IncompatibleOptionsError(f"{RECORD} has format {record.get('format')!r}; this hf_accel reads {FORMAT}")
    return record


def _check_same_architecture(model: nn.Module, config: Any) -> None:
    given = getattr(getattr(model, "config", None), "to_dict", dict)()
    saved = config.to_dict()
    keys = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    diff = {k: (saved.get(k), given.get(k)) for k in keys if saved.get(k) != given.get(k)}
    if diff:
        details = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise IncompatibleOptionsError(f"the checkpoint does not match the given model's architecture ({details})")


def _load_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    missing = sorted(set(current) - set(tensors))
    unexpected = sorted(set(tensors) - set(current))
    wrong = sorted(k for k in set(current) & set(tensors) if current[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        raise IncompatibleOptionsError(
            "the checkpoint does not fit this model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shapes {wrong[:3]} "
            f"({len(missing)}/{len(unexpected)}/{len(wrong)} in all)"
        )
    model.load_state_dict(tensors, strict=True)


def load_quantized(
    path: str | os.PathLike[str], model: nn.Module | None = None, device: str | torch.device | None = None,
    **features: Any,
) -> nn.Module:  # fmt: skip
    """Load an int8 checkpoint written by :func:`save_quantized`, patched and ready to generate.

    Args:
        path: the checkpoint folder.
        model: optionally, a float model of the same architecture to load into (its weights are replaced);
            by default one is built from the saved config.
        device: where to put the model.
        **features: other ``patch_model`` features (``paged=``, ``speculative=``, ...); the lossless defaults.

    Returns:
        The patched model (eval mode).

    Raises:
        ModelNotFoundError: ``path`` is not a checkpoint folder.
        IncompatibleOptionsError: ``model`` (or the saved tensors) do not match the checkpoint's architecture.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from .patch import patch_model, unpatch_model

    folder = Path(path)
    record = _read_record(folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if model is None:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, record.get("dtype", "float32")))
    else:
        _check_same_architecture(model, config)
    int8 = Int8Config(
        group_size=record["group_size"],
        skip_modules=tuple(record["skip_modules"]),
        activations=record.get("activations", "float"),
    )
    patch_model(model, int8=int8, **{"fused_mlp": False, **features})
    try:
        _load_tensors(model, load_file(str(folder / WEIGHTS)))
    except BaseException:
        unpatch_model(model)  # a given model is handed back as it came
        raise
    if device is not None:
        model.to(device)
    return model.eval()
