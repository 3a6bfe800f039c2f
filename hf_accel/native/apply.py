"""The ``native`` feature: plain decoding (prompts and decode steps over Transformers' dynamic cache) through the
native executor.

``patch_model(model, native=True)`` binds a :class:`NativeForward` as the instance's ``forward`` (recorded). A call
that ``generate`` makes for a step over a ``DynamicCache`` runs :class:`~.step.LeanStep` (every decoder layer in one
native call, the cache's layers turned into growing ones in place); any other call (another cache, options the step
does not cover, gradients, the paged cache, a compiled step) goes to the forward it replaced, unchanged. Where the
executor cannot serve the model at all (another architecture, hooks...) the feature changes nothing, says why in
``patch_report`` and logs a warning; a bfloat16 / float16 model it cannot serve gets ``half_linear`` decode linears
(:mod:`.half`). A half-precision Llama-family model (``native=True`` asked of it) runs the executor with float32
activations.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..core.config import NativeConfig
from ..core.fingerprint import tensor_version
from ..core.recorder import Recorder
from ..core.registry import ModelParts
from ..kernels.ops import choose
from ..paged.cache import PagedCache
from .coded import CODED_MAX_ROWS, CodeBook
from .growing import GrowingLayer, to_growing
from .half import apply_half_linears, half_unavailable
from .paged import paged_hidden, paged_logits, serves_pool
from .step import LeanStep

__all__ = ["NativeForward", "apply_native", "executor_declines", "native_unavailable"]

logger = logging.getLogger(__name__)
FEATURE = "native"

#: ``forward`` keyword arguments a native step understands; any other sends the call to the replaced forward
_STEP_KWARGS = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache", "use_cache", "return_dict", "logits_to_keep"}
)


def _fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """Where and how every weight of ``model`` is stored, and its version counter: a new tensor (``model.to(...)``,
    ``param.data = ...``, a replaced module) changes it, and so does an in-place update (the executor reads float
    weights in place, but exact codes (:mod:`.coded`) were found in the old values)."""
    return tuple((t.data_ptr(), t.dtype, t.device, tensor_version(t)) for t in (*model.parameters(), *model.buffers()))


class NativeForward:
    """A model's ``forward`` (bound on the instance) that runs calls over a dynamic cache through the executor.

    The executor holds the weights it read; at the start of every sequence (an empty cache) the model's weights are
    checked to still be those tensors, and the executor is rebuilt from the model otherwise (or, where it cannot
    serve the changed model, the replaced forward runs, with a warning; so does a float32 model cast to half precision
    after patching: the half-precision executor is opt-in).

    Args:
        model: the patched model.
        step: the model's :class:`~.step.LeanStep` (native layers, float32 K/V).
        inner: the forward it replaces (the class's, or another feature's instance forward).
        prompts: run prompts natively too (``NativeConfig.prompts``).
    """

    def __init__(
        self,
        model: nn.Module,
        step: LeanStep,
        inner: Callable[..., Any],
        prompts: bool,
        half: bool = True,
        codebook: CodeBook | None = None,
    ) -> None:
        self.step: LeanStep | None = step
        self.codebook = codebook
        self.inner, self.prompts = inner, prompts
        #: half-precision weights run the executor too (``NativeConfig.half_precision``), after a cast as well
        self.half = half
        self._model = weakref.ref(model)
        self._weights = _fingerprint(model)
        self._lock = threading.Lock()
        self.calls = 0  # calls that ran natively (for tests and reports)
        functools.update_wrapper(self, inner)  # generate inspects forward's signature

    def _current(self, values: bool = False) -> LeanStep | None:
        """The executor for the model's weights as they are now (rebuilt once after they changed; ``values``: also
        compare the values sampled from weights that run as exact codes, for writes through ``.data``)."""
        model = self._model()
        if model is None:
            return None
        weights = _fingerprint(model)
        with self._lock:
            stale = values and self.step is not None and self.step.codes_stale()
            if weights != self._weights or stale:
                self.step = LeanStep.exact(model, half=self.half, codebook=self.codebook)  # cast to half: its own
                self._weights = weights
                if self.step is None and self.codebook is not None:
                    self.codebook.keep_only([])  # no executor: keep no old weights alive for codes
                if self.step is None:
                    logger.warning("hf_accel: native: the model's weights changed and the executor cannot serve it "
                                   "any more; its own forward runs")  # fmt: skip
            return self.step

    def current_step(self) -> LeanStep | None:
        """The executor for the model's weights as they are now (rebuilt after they changed, e.g. a cast; ``None``
        where it no longer serves them): what another feature running the same step (a speculative target) uses."""
        return self._current()

    def __deepcopy__(self, memo: dict[int, object]) -> Any:
        # a deep copy of the model runs its class's forward (hf_accel.core.state.plain_copy drops the attribute)
        model = self._model()
        copied = memo.get(id(model)) if model is not None else None
        return None if copied is None else types.MethodType(type(copied).forward, copied)

    def _runner(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[DynamicCache, LeanStep] | None:
        """The call's dynamic cache and the executor to run it, or ``None`` (the replaced forward runs it)."""
        cache, keep = kwargs.get("cache"), kwargs.get("logits_to_keep", 0)
        if not _plain_step(args, kwargs) or type(cache) is not DynamicCache or not isinstance(keep, int):
            return None
        if any(type(layer) not in (DynamicLayer, GrowingLayer) for layer in cache.layers):
            return None  # sliding windows, quantized layers...: Transformers' own
        fresh = cache.get_seq_length() == 0
        if fresh and not self.prompts:
            return None
        step = self._current(values=True) if fresh else self.step  # a new sequence: still the weights it read?
        if step is None:
            return None
        to_growing(cache)  # in place, same contract: new tokens are written into spare capacity
        return (cache, step) if step.native.serves(cache) else None

    def hidden_states(self, **kwargs: Any) -> torch.Tensor | None:
        """What ``model.model(**kwargs).last_hidden_state`` returns, through the executor's paged build, for a
        decode-sized chunk over hf_accel's paged cache (a speculative target verifying through its screened head);
        ``None`` where it does not take the call."""
        cache = kwargs.get("cache")
        if not isinstance(cache, PagedCache) or not _plain_step((), kwargs):
            return None
        step = self._current()
        if step is None or not serves_pool(step, cache):
            return None
        states = paged_hidden(step, cache, kwargs)
        self.calls += states is not None
        return states

    def _paged(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call over hf_accel's paged cache through the executor's paged build (:mod:`.paged`), or ``None``."""
        cache = kwargs.get("cache")
        if not isinstance(cache, PagedCache) or not _plain_step(args, kwargs):
            return None
        step = self._current()  # the weights may have been replaced since (no sequence start to wait for here)
        if step is None or not serves_pool(step, cache):
            return None
        logits = paged_logits(step, cache, kwargs)
        if logits is None:
            return None
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self.calls += 1
        return CausalLMOutputWithPast(logits=logits, cache=cache)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        paged = self._paged(args, kwargs)
        if paged is not None:
            return paged
        runner = self._runner(args, kwargs)
        if runner is None:
            return self.inner(*args, **kwargs)
        cache, step = runner
        ids = kwargs["input_ids"]  # [B, C]
        width, past = ids.shape[1], cache.get_seq_length()
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(ids.shape[0], past + width, dtype=torch.long, device=ids.device)
        if mask.ndim != 2 or mask.shape != (ids.shape[0], past + width):
            return self.inner(*args, **kwargs)  # a 4D mask or one of another length: the model's own forward
        if width > 1 and not step.takes_prompt(cache, mask.numel() * width):
            return self.inner(*args, **kwargs)  # a prompt too large for the native call's boolean mask
        positions = kwargs.get("position_ids")
        if positions is None:  # what the model computes: each real token's index in its row
            positions = (mask.long().cumsum(1) - 1).clamp_min(0)[:, -width:]
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits = step(ids, mask, positions, cache, last=kwargs.get("logits_to_keep", 0))  # [B, C or keep, V]
        self.calls += 1
        return CausalLMOutputWithPast(logits=logits, cache=cache)


def _plain_step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``forward`` call is one the executor may run: keywords it knows, ``[B, C]`` ids, no gradients, the
    cache used and a model output returned."""
    ids = kwargs.get("input_ids")
    return (
        not args
        and _STEP_KWARGS.issuperset(kwargs)
        and not torch.is_grad_enabled()
        and isinstance(ids, torch.Tensor)
        and ids.ndim == 2
        and kwargs.get("use_cache") is not False
        and kwargs.get("return_dict") is not False
    )


def _executor(
    model: nn.Module, half: bool = True, codebook: CodeBook | None = None
) -> tuple[str | None, LeanStep | None]:
    """The executor's step for ``model``, or why there is none (``half``: half-precision weights may run it;
    ``codebook``: weights that are exact codes run from them)."""
    why = LeanStep.unsupported(model)
    step = LeanStep.exact(model, half=half, codebook=codebook) if why is None else None  # built once where it serves
    if step is not None:
        return None, step
    if why is None:  # the layers are the family's, but no native build takes them (or half precision is off)
        built = LeanStep.build(model, kv_dtype=torch.float32)
        why = built.why_not_native
        if why is None and built.native is not None and built.native.half is not None:
            why = f"{built.native.half} weights, and NativeConfig(half_precision=False)"
    return why or "no native layers apply", None


def executor_declines(model: nn.Module) -> str | None:
    """Why the executor's layers are not ``model``'s (architecture, hooks), without building it: a cheap first look
    (``None``: the layers are the family's; :func:`native_unavailable` then says whether a build takes them)."""
    return LeanStep.unsupported(model)


def native_unavailable(model: nn.Module) -> str | None:
    """Why the native executor cannot serve ``model`` as it is (``None``: it can)."""
    return _executor(model)[0]


def apply_native(model: nn.Module, parts: ModelParts, config: NativeConfig, recorder: Recorder) -> None:
    """Bind :class:`NativeForward` as ``model.forward`` where the executor serves the model; else note why (and warn).

    Side effects:
        ``model.forward`` is set on the instance (recorded; ``unpatch_model`` removes it).
    """
    del parts
    codebook = CodeBook() if config.exact_codes else None
    why, step = _executor(model, config.half_precision, codebook)
    if step is None:
        recorder.note(FEATURE, f"executor not used: {why}")
        recorder.choose(FEATURE, "decoder_layers", "model forward", f"the executor cannot serve this model: {why}")
        if half_unavailable(model) is None:  # bf16 / fp16 weights: their decode rows through half_linear
            apply_half_linears(model, recorder)
            return
        name = type(model).__name__
        logger.warning("hf_accel: native: the executor cannot serve %s (%s); it runs its own forward", name, why)
        return
    choice = step.native.choice
    recorder.choose(FEATURE, "decoder_layers", choice.impl, choice.why, choice.rejected)
    inner = model.__dict__.get("forward") or types.MethodType(type(model).forward, model)
    _record_codes(step, config, recorder)
    native = NativeForward(model, step, inner, config.prompts, config.half_precision, codebook)
    recorder.set_instance_attr(FEATURE, model, "forward", native, "forward runs the native executor (dynamic cache)")


def _record_codes(step: LeanStep, config: NativeConfig, recorder: Recorder) -> None:
    """Say in ``patch_report`` which projections run from exact codes (``coded_linear``), or why none does."""
    if not config.exact_codes:
        recorder.choose(FEATURE, "coded_linear", "off", "NativeConfig(exact_codes=False)", {})
        return
    summary = step.native.codebook.summary(step.float_weights())
    if not summary["coded"]:
        why = "; ".join(summary["not"]) or "no float32 projection weights"
        recorder.choose(FEATURE, "coded_linear", "float weights", f"no weight is exact codes: {why}", {})
        return
    choice = choose("coded_linear", "cpu")
    recorder.choose(FEATURE, "coded_linear", choice.impl, choice.why, choice.rejected)
    bits = "/".join(str(b) for b in summary["bits"])
    recorder.note(
        FEATURE,
        f"exact {bits}-bit codes for {summary['coded']} of {summary['of']} float32 weights (decode steps and chunks "
        f"of up to {CODED_MAX_ROWS} rows): {summary['code_bytes'] / 1e6:.0f} MB read per step instead of "
        f"{summary['float_bytes'] / 1e6:.0f} MB, the same float32 values"
        + (f"; not coded: {'; '.join(summary['not'])}" if summary["not"] else ""),
    )
