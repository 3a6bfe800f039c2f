"""The ``speculative`` feature: ``generate`` keywords that switch a call to speculative decoding.

On a patched model::

    model.generate(ids, speculative=PromptLookup())               # any Strategy instance
    model.generate(ids, prompt_lookup=True)                         # PromptLookup with the patch's config
    model.generate(ids, draft_model=small, num_speculative_tokens=4)
    model.generate(ids, speculative=True)                           # the strategy named by SpeculativeConfig

The call goes to Transformers' ``generate`` with ``custom_generate=`` set to hf_accel's loop, so every other
argument (generation config, logits processors, stopping criteria, streamers, ``return_dict_in_generate``)
is prepared by Transformers as usual. Patching changes nothing on the model itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.call import GenerateCall, GenerateKwarg
from ..core.config import SpeculativeConfig
from ..core.errors import IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.registry import ModelParts
from .auto import AUTO_NOTE, auto_refusal, memory_refusal
from .kept import KeptStrategies
from .loop import make_custom_generate
from .output import SpeculativeStats
from .strategies import PromptLookup, Strategy

if TYPE_CHECKING:
    from ..core.state import PatchState

__all__ = ["KEPT", "STATS_NOTE", "apply_speculative", "bind_speculative"]

logger = logging.getLogger("hf_accel")

FEATURE = "speculative"
#: ``state.extras`` key of the model's :class:`~.kept.KeptStrategies`
KEPT = "speculative_strategies"
#: ``GenerateCall.notes`` key of the call's :class:`~.output.SpeculativeStats`
STATS_NOTE = "speculative_stats"
_KWARGS = ("speculative", "prompt_lookup", "draft_model", "num_speculative_tokens")
_AUTO_BUILT = "speculative_auto_built"  # state.extras: the automatic self-speculative draft was announced
_TRANSFORMERS_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def apply_speculative(model: nn.Module, parts: ModelParts, cfg: SpeculativeConfig, recorder: Recorder) -> None:
    del model, parts, cfg  # nothing on the model changes: the feature only adds generate keywords
    recorder.note(FEATURE, "generate keywords speculative / prompt_lookup / draft_model / num_speculative_tokens")


def _strategy_from_config(cfg: SpeculativeConfig, num_tokens: int | None, draft: nn.Module | None) -> Strategy:
    """The strategy ``cfg`` names; ``num_tokens`` (a generate keyword) overrides ``cfg.num_tokens``."""
    from .draft import DraftModel
    from .self_draft import SelfSpeculative

    options: dict[str, Any] = {}
    k = num_tokens if num_tokens is not None else cfg.num_tokens
    if k is not None:
        options["num_tokens"] = k
    if cfg.adaptive is not None:
        options["adaptive"] = cfg.adaptive
    if cfg.strategy == "draft":
        if draft is None:
            raise IncompatibleOptionsError("SpeculativeConfig(strategy='draft') needs generate(draft_model=...)")
        return DraftModel(draft, **options)
    if cfg.strategy == "self":
        return SelfSpeculative(**options)
    return PromptLookup(max_ngram=cfg.max_ngram, **options)


def _kept_strategy(
    kept: KeptStrategies, cfg: SpeculativeConfig, num_tokens: int | None, draft: nn.Module | None
) -> tuple[Strategy, Callable[[], None] | None]:
    """A strategy for these options lent by the patched model (see :mod:`.kept`), and the function that gives it
    back when the call ends."""
    return kept.lend(cfg.strategy, (cfg, num_tokens), draft, lambda: _strategy_from_config(cfg, num_tokens, draft))


def _resolve(
    values: dict[str, Any], cfg: SpeculativeConfig, kept: KeptStrategies | None = None
) -> tuple[Strategy | None, Callable[[], None] | None]:
    """The strategy one call asks for through the plugin keywords (``None``: none), and the function that gives a
    kept one back after the call (``None`` for a user's instance).

    ``kept``: the patched model's keyword-made strategies (reused across calls); ``None`` makes new ones.
    """
    kept = KeptStrategies() if kept is None else kept
    spec, lookup = values.get("speculative"), values.get("prompt_lookup")
    draft, k = values.get("draft_model"), values.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise IncompatibleOptionsError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
    asked = [name for name, v in (("speculative", spec), ("prompt_lookup", lookup), ("draft_model", draft)) if v]
    if len(asked) > 1:
        raise IncompatibleOptionsError(
            f"generate() takes one of speculative=, prompt_lookup=, draft_model=; got {asked}"
        )
    if isinstance(spec, Strategy):
        if k is not None:
            raise IncompatibleOptionsError(
                "num_speculative_tokens= does not apply to a Strategy instance; set num_tokens on the strategy"
            )
        return spec, None
    if spec is True:
        return _kept_strategy(kept, cfg, k, None)
    if isinstance(spec, SpeculativeConfig):
        return _kept_strategy(kept, spec, k, None)
    if spec not in (None, False):
        raise IncompatibleOptionsError(
            f"generate(speculative=...) takes a Strategy, a SpeculativeConfig or True, got {type(spec).__name__}"
        )
    if lookup:
        if lookup is not True:
            raise IncompatibleOptionsError(f"generate(prompt_lookup=...) takes True, got {lookup!r}")
        return _kept_strategy(kept, dataclasses.replace(cfg, strategy="prompt_lookup"), k, None)
    if draft is not None:
        return _kept_strategy(kept, dataclasses.replace(cfg, strategy="draft"), k, draft)
    if k is not None:
        raise IncompatibleOptionsError("num_speculative_tokens= needs draft_model=, prompt_lookup=True or speculative=")
    return None, None


def _check_call(model: nn.Module, call: GenerateCall) -> None:
    kwargs = call.kwargs
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)  # as generate reads it
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1) if config is not None else 1)
    if beams and beams > 1:
        raise IncompatibleOptionsError(
            f"speculative generation cannot be combined with beam search (num_beams={beams}); use num_beams=1"
        )
    guidance = kwargs.get("guidance_scale", getattr(config, "guidance_scale", None))
    if guidance is not None and guidance != 1:
        # Transformers' processor runs the model on the unconditional input once per token, in order, over its own
        # cache: a verification's several positions per call would advance it wrongly
        raise IncompatibleOptionsError(
            f"speculative generation cannot be combined with classifier-free guidance (guidance_scale={guidance}): "
            "drop guidance_scale, or the speculative keyword for this call"
        )
    clashing = [name for name in _TRANSFORMERS_ASSISTED if kwargs.get(name) is not None]
    if clashing:
        raise IncompatibleOptionsError(
            f"hf_accel's speculative generation replaces Transformers' assisted generation; drop {clashing}"
        )
    if kwargs.get("custom_generate") is not None:
        raise IncompatibleOptionsError("speculative generation sets custom_generate itself; do not pass one")


def _stop_strings_here(model: nn.Module, call: GenerateCall) -> None:
    """Build the call's stop-string criterion here: Transformers drops ``tokenizer=`` for a ``custom_generate``
    callable before it builds its own criteria (they would then fail to find a tokenizer).

    Raises:
        IncompatibleOptionsError: stop strings without ``tokenizer=``.
    """
    from transformers import StoppingCriteriaList, StopStringCriteria

    kwargs = call.kwargs
    config = kwargs.get("generation_config") or model.generation_config
    stops = kwargs["stop_strings"] if "stop_strings" in kwargs else getattr(config, "stop_strings", None)
    if not stops:
        return
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise IncompatibleOptionsError(
            f"stop_strings={stops!r} need the tokenizer: pass generate(..., tokenizer=tokenizer)"
        )
    kwargs["stop_strings"] = None  # Transformers builds no second (tokenizer-less) criterion
    given = kwargs.get("stopping_criteria") or []
    kwargs["stopping_criteria"] = StoppingCriteriaList([*given, StopStringCriteria(tokenizer, stops)])


def _auto_strategy(
    model: nn.Module, call: GenerateCall, cfg: SpeculativeConfig, kept: KeptStrategies, extras: dict[str, Any]
) -> tuple[Strategy | None, Callable[[], None] | None]:
    """The ``cfg.auto`` strategy for a call without speculative keywords, or ``(None, None)`` with the reason in
    ``call.notes[AUTO_NOTE]`` where the call must decode as usual."""
    why = auto_refusal(model, call)
    if why is None:
        try:
            _check_call(model, call)  # what an explicit speculative call would be refused for
        except IncompatibleOptionsError as err:
            why = str(err)
    if why is None and cfg.auto == "self" and not extras.get(_AUTO_BUILT):
        why = memory_refusal(model)
    if why is not None:
        call.notes[AUTO_NOTE] = why
        logger.debug("hf_accel: this generate call does not speculate automatically: %s", why)
        return None, None
    if cfg.auto == "self" and not extras.get(_AUTO_BUILT):
        extras[_AUTO_BUILT] = True
        logger.warning(
            "hf_accel: greedy generate calls speculate with an int8 copy of %s as the draft (the default patch on "
            "this CPU; output unchanged): building it once now. patch_model(model, speculative="
            "SpeculativeConfig(auto=None)) turns this off",
            type(model).__name__,
        )
    return _kept_strategy(kept, dataclasses.replace(cfg, strategy=cfg.auto), None, None)


def _then(proceed: Callable[[], Any], give_back: Callable[[], None]) -> Any:
    try:
        return proceed()
    finally:
        give_back()


def bind_speculative(model: nn.Module, state: PatchState, cfg: SpeculativeConfig) -> None:
    """Add the speculative ``generate`` keywords to a patched model."""

    def remember(name: str):
        def apply(model: nn.Module, value: Any, call: GenerateCall) -> None:
            call.notes.setdefault(FEATURE, {})[name] = value

        return apply

    kept = state.extras.setdefault(KEPT, KeptStrategies())

    def hook(model: nn.Module, call: GenerateCall) -> None:
        strategy, give_back = _resolve(call.notes.get(FEATURE, {}), cfg, kept)
        if strategy is None and cfg.auto is not None:
            strategy, give_back = _auto_strategy(model, call, cfg, kept, state.extras)
        if strategy is None:
            return
        if give_back is not None:  # before anything else can fail: the lent strategy always goes back
            call.around.insert(0, lambda proceed: _then(proceed, give_back))
        _check_call(model, call)
        _stop_strings_here(model, call)

        def keep(stats: SpeculativeStats) -> None:
            call.notes[STATS_NOTE] = stats  # this call's own (threads never see each other's)

        call.kwargs["custom_generate"] = make_custom_generate(strategy, call.kwargs.get("streamer"), keep)

    for name in _KWARGS:
        state.generate_kwargs[name] = GenerateKwarg(name, FEATURE, remember(name))
    state.call_hooks.append(hook)
