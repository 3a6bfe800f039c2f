"""``model.generate_many(prompts)``: continuous batching bound on a patched model (with its ``paged`` feature)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..core.errors import IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.state import get_state
from .engine import Engine

__all__ = ["bind_generate_many"]


def bind_generate_many(model: nn.Module, recorder: Recorder) -> None:
    """Bind ``generate_many`` on this instance (recorded, so ``unpatch_model`` removes it)."""

    def generate_many(
        prompts: Any, tokenizer: Any = None, engine: Engine | None = None, **generate_kwargs: Any
    ) -> list:
        """Generate for many prompts with continuous batching (:class:`hf_accel.Engine`); see
        :meth:`hf_accel.Engine.generate_many`. ``engine``: an existing engine of this model (default: one kept by
        the model, built on first use with the engine's defaults)."""
        if engine is None:
            extras = get_state(model).extras
            engine = extras.get("engine")
            if engine is None or engine.tokenizer is not tokenizer:
                engine = extras["engine"] = Engine(model, tokenizer)
        elif engine.model is not model:
            raise IncompatibleOptionsError("generate_many(engine=...) got an engine built for another model")
        return engine.generate_many(prompts, **generate_kwargs)

    recorder.set_instance_attr("paged", model, "generate_many", generate_many, "generate_many bound")
