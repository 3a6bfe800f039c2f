"""hf_accel: fast causal-LM inference for Hugging Face Transformers, without touching model code.

Quick start::

    import hf_accel
    model = hf_accel.patch_model(model)          # lossless features only
    out = model.generate(**inputs, max_new_tokens=64)
"""

from .checkpoint import load_quantized, save_quantized
from .core.config import (
    AccelConfig,
    CompileConfig,
    FusedMLPConfig,
    Int8Config,
    NativeConfig,
    PagedConfig,
    SpeculativeConfig,
)
from .core.errors import (
    AlreadyPatchedError,
    CacheFullError,
    CheckpointError,
    DefaultModelNotInstalledError,
    FeatureNotAvailableError,
    HFAccelError,
    IncompatibleOptionsError,
    ModelNotFoundError,
    NotPatchedError,
    UnsupportedModelError,
    UnsupportedVersionError,
)
from .core.metrics import GenerationStats
from .core.registry import supported_model_types
from .engine import Engine, EngineStoppedError, FinishReason, RequestFailedError, RequestOutput, UnknownRequestError
from .fused import FusedGatedMLP
from .models import load_default, load_model
from .paged.cache import PagedCache
from .patch import is_patched, last_stats, patch_model, patch_report, unpatch_model
from .quant.hf_quantizer import is_quantizer_registered, register_quantizer, unregister_quantizer

__version__ = "0.1.0"

__all__ = [
    "AccelConfig",
    "AlreadyPatchedError",
    "CacheFullError",
    "CheckpointError",
    "CompileConfig",
    "DefaultModelNotInstalledError",
    "Engine",
    "EngineStoppedError",
    "FeatureNotAvailableError",
    "FinishReason",
    "FusedGatedMLP",
    "FusedMLPConfig",
    "GenerationStats",
    "HFAccelError",
    "IncompatibleOptionsError",
    "Int8Config",
    "ModelNotFoundError",
    "NativeConfig",
    "NotPatchedError",
    "PagedCache",
    "PagedConfig",
    "RequestFailedError",
    "RequestOutput",
    "SpeculativeConfig",
    "UnknownRequestError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "__version__",
    "is_patched",
    "is_quantizer_registered",
    "last_stats",
    "load_default",
    "load_model",
    "load_quantized",
    "patch_model",
    "patch_report",
    "register_quantizer",
    "save_quantized",
    "supported_model_types",
    "unpatch_model",
    "unregister_quantizer",
]
