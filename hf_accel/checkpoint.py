"""Quantize once, reload in seconds: int8 checkpoints as safetensors plus a small JSON record.

Layout of a checkpoint folder::

    config.json                 the model's Transformers config
    hf_accel_int8.json          format, backend, group size, skipped modules, model type, tensor names
    model.int8.safetensors      the patched model's state dict: int8 ``qweight`` + float32 ``scale`` (+ ``bias``)
                                for every quantized linear, int8 ``gate_up_proj`` / ``down_proj`` + float32
                                ``gate_up_proj_scale`` / ``down_proj_scale`` for every mixture of experts' experts,
                                float tensors for everything else
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
from .core.errors import CheckpointError, IncompatibleOptionsError, ModelNotFoundError, NotPatchedError
from .core.state import get_state
from .quant.bnb import is_bnb_linear
from .quant.linear import Int8Linear
from .quant.quanto import is_quanto_linear

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
    if cfg is not None and any(is_bnb_linear(m) or is_quanto_linear(m) for m in model.modules()):
        raise IncompatibleOptionsError(
            "save_quantized writes the native backend's format; this model holds bitsandbytes / optimum-quanto "
            "layers. Patch with Int8Config(backend='native') to save, or re-quantize with that backend after loading"
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


#: dtypes a checkpoint's float tensors may be saved in (its record's ``dtype`` field)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _read_record(folder: Path) -> dict[str, Any]:
    """The checkpoint's JSON record, every field checked.

    Raises:
        ModelNotFoundError: not a checkpoint folder.
        CheckpointError: unreadable JSON, not an object, a missing or malformed field.
    """
    record_path = folder / RECORD
    if not record_path.is_file() or not (folder / WEIGHTS).is_file():
        raise ModelNotFoundError(
            f"{str(folder)!r} is not an hf_accel int8 checkpoint (no {RECORD} / {WEIGHTS}); "
            "write one with hf_accel.save_quantized(model, path)"
        )
    try:
        record = json.loads(record_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{record_path} is not valid JSON ({exc}); write it again with save_quantized") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{record_path} must hold a JSON object, got {type(record).__name__}")
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"{record_path}: field 'format' is {record.get('format')!r}; this hf_accel reads {FORMAT}"
        )
    _check_fields(record_path, record)
    return record


def _check_fields(path: Path, record: dict[str, Any]) -> None:
    missing = [k for k in ("group_size", "skip_modules") if k not in record]
    if missing:
        raise CheckpointError(
            f"{path}: field {missing[0]!r} is missing; write the checkpoint again with save_quantized"
        )
    group, skip = record["group_size"], record["skip_modules"]
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise CheckpointError(f"{path}: field 'group_size' must be null or an int >= 1, got {group!r}")
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise CheckpointError(f"{path}: field 'skip_modules' must be a list of strings, got {skip!r}")
    if record.get("dtype", "float32") not in DTYPES:
        raise CheckpointError(f"{path}: field 'dtype' is {record.get('dtype')!r}; one of {sorted(DTYPES)} expected")
    if record.get("activations", "float") not in ("float", "int8"):
        raise CheckpointError(f"{path}: field 'activations' is {record.get('activations')!r}; 'float' or 'int8'")


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, int8 ones checked: ``qweight`` int8, ``scale`` floating point, finite, > 0.

    Raises:
        CheckpointError: an unreadable (empty, truncated, garbage) file or a bad tensor.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"{path} cannot be read as safetensors ({exc}); the file is damaged or incomplete: write it again "
            "with save_quantized"
        ) from None
    for name, t in tensors.items():
        if name.endswith(".qweight") and t.dtype != torch.int8:
            raise CheckpointError(f"{path}: tensor {name!r} must be int8, got {t.dtype}")
        if f"{name}_scale" in tensors and t.dtype != torch.int8:  # int8 experts: gate_up_proj + gate_up_proj_scale
            raise CheckpointError(f"{path}: tensor {name!r} must be int8, got {t.dtype}")
        if name.endswith((".scale", "_proj_scale")):
            if not t.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name!r} must be floating point, got {t.dtype}")
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise CheckpointError(f"{path}: tensor {name!r} holds NaN, infinite or negative scales")
    return tensors


def _check_same_architecture(model: nn.Module, config: Any) -> None:
    given = getattr(getattr(model, "config", None), "to_dict", dict)()
    saved = config.to_dict()
    keys = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    diff = {k: (saved.get(k), given.get(k)) for k in keys if saved.get(k) != given.get(k)}
    if diff:
        details = ", ".join(f"{k}: checkpoint {a!r} vs model {b!r}" for k, (a, b) in diff.items())
        raise IncompatibleOptionsError(f"the checkpoint does not match the given model's architecture ({details})")


def _load_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    current = model.state_dict()
    missing = sorted(set(current) - set(tensors))
    unexpected = sorted(set(tensors) - set(current))
    wrong = sorted(k for k in set(current) & set(tensors) if current[k].shape != tensors[k].shape)
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{path} does not fit this model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shapes {wrong[:3]} "
            f"({len(missing)}/{len(unexpected)}/{len(wrong)} in all)"
        )
    model.load_state_dict(tensors, strict=True)


def _float_experts(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The experts modules a checkpoint holds in float (written before the int8 feature quantized experts, or skipped
    when saving): loaded as they were saved."""
    suffix = ".gate_up_proj"
    return [
        name.removesuffix(suffix)
        for name, t in tensors.items()
        if name.endswith(suffix) and t.is_floating_point() and f"{name}_scale" not in tensors
    ]


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
        CheckpointError: a damaged file (the message names it, and the field or tensor): bad JSON or fields,
            unreadable weights, int8 tensors of another dtype, NaN/inf/negative scales, tensors that do not fit.
        IncompatibleOptionsError: ``model`` does not match the checkpoint's architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .patch import patch_model, unpatch_model

    folder = Path(path)
    record = _read_record(folder)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder / 'config.json'} cannot be read as a Transformers config ({exc})") from None
    tensors = _read_weights(folder)  # before anything is built or patched
    if model is None:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[record.get("dtype", "float32")])
    else:
        _check_same_architecture(model, config)
    try:
        int8 = Int8Config(
            group_size=record["group_size"],
            skip_modules=(*record["skip_modules"], *_float_experts(tensors)),
            activations=record.get("activations", "float"),
        )
    except IncompatibleOptionsError as exc:
        raise CheckpointError(f"{folder / RECORD}: {exc}") from None
    patch_model(model, int8=int8, **{"fused_mlp": False, **features})
    try:
        _load_tensors(model, tensors, folder / WEIGHTS)
    except BaseException:
        unpatch_model(model)  # a given model is handed back as it came
        raise
    if device is not None:
        model.to(device)
    return model.eval()
