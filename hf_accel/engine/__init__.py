"""Continuous batching over the paged KV cache: :class:`Engine` and its pure scheduler."""

from .engine import Engine, EngineStoppedError, UnknownRequestError
from .request import FinishReason, RequestFailedError, RequestOutput, TokenLogprob

__all__ = [
    "Engine",
    "EngineStoppedError",
    "FinishReason",
    "RequestFailedError",
    "RequestOutput",
    "TokenLogprob",
    "UnknownRequestError",
]
