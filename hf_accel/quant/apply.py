"""Adapter: swap a model's linears (decoder layers + LM head) for int8 ones, recorded.

Backends: ``"native"`` (:class:`Int8Linear`, hf_accel's kernels), ``"bitsandbytes"`` (``Linear8bitLt``) and
``"quanto"`` (optimum-quanto's ``QLinear``).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
from collections.abc import Callable

import torch
from torch import nn

from ..core.config import Int8Config
from ..core.dispatch import TPRowwise, check_resident, is_sharded, local_tensor, tp_group, tp_style, transfer_hook
from ..core.errors import IncompatibleOptionsError
from ..core.recorder import Recorder
from ..core.registry import ArchSpec, ModelParts, decoder_linears, get_attr_path, named_experts, parent_and_name
from .bnb import bnb_dequantize, bnb_module, is_bnb_linear, to_bnb_linear
from .codes import Codes, find_codes
from .core import dequantize, quantize
from .experts import PROJECTIONS, Int8Experts, check_layout
from .linear import Int8Embedding, Int8Linear, check_w8a8, kernel_choice
from .model_apis import bind_model_apis, warn_lossy_unpatch
from .quanto import is_quanto_linear, quanto_dequantize, quanto_module, to_quanto_linear

__all__ = [
    "apply_int8",
    "can_tie_embedding",
    "int8_experts_kept",
    "int8_targets",
    "quantize_linears",
    "quantize_moe_experts",
    "record_int8_experts",
    "resolve_backend",
]

logger = logging.getLogger(__name__)
FEATURE = "int8"


def int8_targets(model: nn.Module, spec: ArchSpec, config: Int8Config) -> list[tuple[str, nn.Linear]]:
    """``(name, linear)`` of every plain ``nn.Linear`` the int8 feature quantizes: the decoder layers' and the LM
    head, minus ``config.skip_modules``."""
    return [
        (name, linear)
        for name, linear in decoder_linears(model, spec)
        if not any(fnmatch.fnmatchcase(name, pattern) for pattern in config.skip_modules)
    ]


def resolve_backend(config: Int8Config, device: torch.device) -> str:
    """The backend ``config.backend`` means on ``device``.

    ``"auto"`` picks ``"native"`` on CPU (its AVX2 kernel decodes ~3x faster than fp32 here, bitsandbytes
    ~1x), on CUDA (a Triton W8A16 kernel for decode-sized calls, docs/cuda.md; bitsandbytes' LLM.int8() matmuls
    stay available as ``backend="bitsandbytes"``) and whenever a
    ``group_size`` is set (bitsandbytes has row scales only); on other devices (MPS) ``"quanto"`` when
    optimum-quanto is installed, else ``"native"``. W8A8 (``activations="int8"``) is native only.
    """
    if config.backend != "auto":
        return config.backend
    row_scales = config.group_size is None and config.activations == "float"
    if device.type in ("cpu", "cuda") or not row_scales:
        return "native"
    if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None:
        return "quanto"  # real int8 layers where the native backend would de-quantize per call (CUDA, MPS)
    return "native"


def _check(model: nn.Module, config: Int8Config, backend: str) -> None:
    if backend == "bitsandbytes":
        bnb_module()  # a clear FeatureNotAvailableError when it is not installed
    if backend == "quanto":
        quanto_module()
    if any(isinstance(m, (Int8Linear, Int8Experts)) or is_quanto_linear(m) for m in model.modules()):
        raise IncompatibleOptionsError("the model already holds Int8Linear layers; it is quantized already")
    dtype = model.get_input_embeddings().weight.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise IncompatibleOptionsError(f"int8 quantization needs float32/float16/bfloat16 weights, got {dtype}")


def _check_w8a8(targets: list[tuple[str, nn.Linear]], device: torch.device, recorder: Recorder) -> None:
    """Every target must take W8A8; say (and log) when the maths runs emulated rather than in integer dots."""
    for name, linear in targets:
        try:
            check_w8a8(linear.in_features, None)
        except ValueError as err:
            raise IncompatibleOptionsError(
                f"{name}: {err}; leave it in float with Int8Config(skip_modules=[{name!r}]) or use "
                "activations='float' (weight-only)"
            ) from None
    choice = kernel_choice("int8", targets[0][1].in_features, targets[0][1].in_features, device) if targets else None
    if choice is not None and not choice.native:
        recorder.note(FEATURE, "W8A8 emulated in float (no integer-dot kernel)")
        logger.warning(
            "hf_accel: W8A8 runs emulated in float (%s): same results as the integer-dot kernel within float rounding, "
            "slower than weight-only int8 (activations='float')",
            "; ".join(f"{k}: {v}" for k, v in choice.rejected.items()),
        )


def _swap(
    recorder: Recorder,
    model: nn.Module,
    name: str,
    old: nn.Module,
    new: nn.Module,
    keep: bool,
    dequant: Callable[[str, torch.dtype], torch.Tensor],
    weights: tuple[str, ...] = ("weight",),
    kind: tuple[str, str] = ("Linear", "weight"),
) -> None:
    """Put ``new`` in module ``name``'s place (``old``'s accelerate hook moved over), recorded, and release ``old``'s
    float ``weights``; undoing gives them back: the originals with ``keep``, else ``dequant(weight name, dtype)``.
    ``kind``: how the report names the module and its weights."""
    parent, attr = parent_and_name(model, name)
    transfer_hook(old, new)
    recorder.set_submodule(FEATURE, parent, attr, new, f"{kind[0]} -> {type(new).__name__}")
    params = [getattr(old, weight) for weight in weights]
    originals = [p.data for p in params] if keep else None  # only kept weights may stay referenced: free the rest

    def restore() -> None:
        for i, (param, weight) in enumerate(zip(params, weights, strict=True)):
            param.data = originals[i] if originals is not None else dequant(weight, param.dtype)

    what = f"float {kind[1]} kept" if keep else f"float {kind[1]} released"
    recorder.release(FEATURE, what, params, restore)


def _note_exact_codes(model: nn.Module, recorder: Recorder) -> None:
    """Say where int8 is the slower choice: the first float32 linear is exact 4-bit / 8-bit codes of a quantized
    checkpoint, which the native executor reads losslessly from fewer bytes (the default patch; docs/native.md)."""
    linear = next((m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32), None)
    codes = find_codes(linear.weight) if linear is not None and linear.weight.is_cpu else None
    if isinstance(codes, Codes) and codes.bits < 16:
        recorder.note(
            FEATURE,
            f"the float32 weights look like exact {codes.bits}-bit codes of a quantized checkpoint: the default patch "
            "(no int8=) reads them losslessly, from fewer bytes than int8",
        )
        logger.info("hf_accel: int8: these float32 weights are exact codes of a quantized checkpoint; the default "
                    "patch without int8= reads them losslessly and faster (docs/native.md)")  # fmt: skip


def apply_int8(model: nn.Module, parts: ModelParts, config: Int8Config, recorder: Recorder) -> None:
    """Quantize every ``nn.Linear`` of the decoder layers and the LM head (minus ``skip_modules``).

    Side effects:
        Linears are replaced by :class:`Int8Linear` (native) or ``Linear8bitLt`` (bitsandbytes). Native: with tied
        embeddings the input embedding becomes an :class:`Int8Embedding` reading the same int8 matrix;
        bitsandbytes leaves a tied LM head in float (its layers cannot serve lookups). Layers that already are
        bitsandbytes 8-bit (``load_in_8bit=True``) are left as they are. Without ``keep_original`` the float
        weights are released and ``unpatch_model`` restores de-quantized values (not bitwise the originals).
    """
    device = next(model.parameters()).device
    backend = resolve_backend(config, device)
    _check(model, config, backend)
    recorder.note(FEATURE, f"backend {backend}")
    _note_exact_codes(model, recorder)
    if backend == "bitsandbytes" and device.type == "cpu":
        logger.warning(
            "hf_accel: bitsandbytes int8 on CPU de-quantizes its weights on every call: about fp32 speed "
            "(0.7-1.1x measured on this CPU) against ~3x for Int8Config(backend='native'), the fast CPU backend"
        )
    if backend == "quanto" and device.type == "cpu":
        logger.warning(
            "hf_accel: optimum-quanto int8 on CPU decodes slower than fp32 (0.46x at batch 1, 0.68x at batch 8 on "
            "SmolLM2, docs/int8.md) against ~2.3x for Int8Config(backend='native'), the fast CPU backend"
        )
    for module in model.modules():
        if is_bnb_linear(module):
            recorder.note(FEATURE, "bitsandbytes layer left as loaded")
    warn_lossy_unpatch(recorder, config.keep_original)  # recorded first: undone last
    quantize_linears(model, parts.spec, config, recorder, backend)
    quantize_moe_experts(model, parts, config, recorder, backend)
    bind_model_apis(model, recorder, backend)
    logger.info("hf_accel: int8 %s", recorder.counts().get(FEATURE, {}))


def quantize_moe_experts(
    model: nn.Module, parts: ModelParts, config: Int8Config, recorder: Recorder, backend: str = "native"
) -> None:
    """Swap every MoE layer's experts module (Transformers' 3-D ``gate_up_proj`` / ``down_proj``) for an
    :class:`Int8Experts` (native backend; weight-only with ``config.group_size``), recorded: the float experts are
    released (kept with ``keep_original``) and ``unpatch_model`` brings them back. Experts left in float (matched by
    ``skip_modules``, another backend, tensor-parallel shards, another storage layout) are said so in a warning and
    in ``patch_report``.

    Raises:
        IncompatibleOptionsError: ``config.group_size`` does not divide an experts projection's input features.
    """
    left: list[tuple[str, str]] = []
    found = named_experts(model, parts.spec)
    for name, experts in found:  # e.g. model.layers.1.mlp.experts
        why = int8_experts_kept(name, experts, config, backend)
        if why is not None:
            left.append((name, why))
            continue
        check_resident(name, experts, "int8", _OFFLOAD_ADVICE)
        try:
            new = Int8Experts.from_module(experts, config.group_size)
        except ValueError as err:
            raise IncompatibleOptionsError(
                f"{name}: {err}; choose a group_size that divides it, or leave these experts in float with "
                f"Int8Config(skip_modules=[{name!r}])"
            ) from None
        _swap(recorder, model, name, experts, new, config.keep_original, new.dequantized, PROJECTIONS,
              ("experts", "experts"))  # fmt: skip
    if len(left) < len(found):
        _record_experts_choice(recorder, new, config)
    if left:
        _note_float_experts(left, recorder)


def int8_experts_kept(name: str, experts: nn.Module, config: Int8Config, backend: str) -> str | None:
    """Why the int8 feature leaves this experts module in float, or ``None``."""
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.skip_modules):
        return "skip_modules"
    if backend != "native":
        return f"the {backend} backend quantizes linears only"
    if any(is_sharded(getattr(experts, proj, None)) for proj in PROJECTIONS):
        return "tensor-parallel experts"
    try:
        check_layout(experts)
    except TypeError as err:
        return str(err)
    return None


def _record_experts_choice(recorder: Recorder, layer: Int8Experts, config: Int8Config) -> None:
    """Say in ``patch_report`` which implementation the int8 experts run, under ``int8`` and ``moe``."""
    described = layer.choices["down_proj"].describe()
    recorder.choose(FEATURE, "int8_experts_linear", described["uses"], described["why"], described["not"])
    record_int8_experts(recorder, described["uses"], "int8=")
    if config.activations == "int8":
        recorder.note(FEATURE, "experts weight-only (W8A8 covers the linears)")


def record_int8_experts(recorder: Recorder, uses: str, source: str) -> None:
    """Say under ``patch_report(model)["implementations"]["moe"]["experts"]`` that :class:`Int8Experts` run the MoE
    layers (``source``: what made them: ``int8=``, or a model loaded int8)."""
    recorder.choose(
        "moe",
        "experts",
        f"hf_accel Int8Experts ({uses})",
        f"{source}: the experts' int8 rows read by int8_experts_linear (the (token, expert) pairs grouped by expert)",
        {"Transformers' experts implementations": "they read float weights; these experts are int8"},
    )


def _note_float_experts(left: list[tuple[str, str]], recorder: Recorder) -> None:
    """Say (and warn) which experts stay in float, and why."""
    reasons = sorted({why for _, why in left})
    recorder.note(FEATURE, f"experts left in float ({'; '.join(reasons)})")
    logger.warning(
        "hf_accel: int8: the experts of %d mixture-of-experts layers stay in float (%s), e.g. %s",
        len(left),
        "; ".join(reasons),
        left[0][0],
    )


def quantize_linears(
    model: nn.Module, spec: ArchSpec, config: Int8Config, recorder: Recorder, backend: str = "native"
) -> None:
    """Swap every remaining ``nn.Linear`` of the decoder layers (a fused MLP's ``gate_up_proj`` included) and the LM
    head, minus ``config.skip_modules``, for ``backend``'s int8 layer; a tied head's embedding reads the int8 matrix
    where it can. The int8 feature's work after its checks; also how a self-speculative draft's private copy is
    quantized (with a throwaway ``recorder``: its float weights are released at once)."""
    embed = get_attr_path(model, spec.embed_tokens)
    head_name = spec.lm_head
    embed_weight = getattr(embed, "weight", None)
    tied = embed_weight is not None and getattr(get_attr_path(model, head_name), "weight", None) is embed_weight
    targets = int8_targets(model, spec, config)
    if config.activations == "int8":
        _check_w8a8(targets, targets[0][1].weight.device if targets else embed_weight.device, recorder)
        recorder.note(FEATURE, "W8A8: activations quantized per token in 16 interleaved feature groups")
    for name, linear in targets:
        check_resident(name, linear, "int8", _OFFLOAD_ADVICE)
        if is_sharded(linear.weight):
            _quantize_shard(recorder, model, name, linear, config, backend)
            continue
        if name == head_name and tied and not can_tie_embedding(embed, backend):
            recorder.note(FEATURE, f"tied lm_head left in float ({backend}: embedding lookup stays float)")
            continue
        if backend == "bitsandbytes":
            new = to_bnb_linear(linear, config.threshold)
            _swap(recorder, model, name, linear, new, config.keep_original, lambda _, dt, m=new: bnb_dequantize(m, dt))
            continue
        if backend == "quanto":
            new = to_quanto_linear(linear)
            _swap(
                recorder, model, name, linear, new, config.keep_original, lambda _, dt, m=new: quanto_dequantize(m, dt)
            )
            continue
        try:
            new = Int8Linear.from_module(linear, config.group_size, config.activations).to(linear.weight.device)
        except ValueError as err:
            raise IncompatibleOptionsError(
                f"{name}: {err}; choose a group_size that divides it, or Int8Config(skip_modules=[{name!r}])"
            ) from None
        _record_choice(recorder, new, linear.weight.device)
        if name == head_name and tied:
            _tie_embedding(model, spec, embed, new, recorder)
        _swap(
            recorder, model, name, linear, new, config.keep_original, lambda _, dt, m=new: dequantize(m.quantized, dt)
        )


def _record_choice(recorder: Recorder, layer: Int8Linear, device: torch.device) -> None:
    """Say in ``patch_report`` which implementation the int8 linears of this shape class run on ``device``."""
    choice = kernel_choice(layer.activations, layer.group_size, layer.in_features, device)
    described = choice.describe()
    if device.type == "cpu" and not choice.native and layer.activations == "float":
        described["why"] += ": the weight is de-quantized for each call (float maths)"
    recorder.choose(FEATURE, choice.op, described["uses"], described["why"], described["not"])


_OFFLOAD_ADVICE = (
    "keep it on a device (a device_map without offload for it), skip it with Int8Config(skip_modules=[...]), or "
    "quantize before dispatching (hf_accel.save_quantized / load_quantized)"
)


def _quantize_shard(
    recorder: Recorder, model: nn.Module, name: str, linear: nn.Linear, config: Int8Config, backend: str
) -> None:
    """Tensor parallelism: quantize this rank's shard; a row-wise one all-reduces its partial output."""
    style = tp_style(model, name)
    if backend != "native":
        raise IncompatibleOptionsError(
            f"int8 backend {backend!r} cannot quantize the tensor-parallel shard {name}; "
            "use Int8Config(backend='native')"
        )
    if style not in ("colwise", "rowwise"):
        recorder.note(FEATURE, f"tensor-parallel {style} linear left in float")
        return
    weight, bias = linear.weight, linear.bias
    w_local = local_tensor(weight)  # [out / tp, in] (colwise) or [out, in / tp] (rowwise)
    absmax = None  # colwise rows are whole; row-wise groups are whole when the shard width is a multiple of them
    if style == "rowwise" and config.group_size is None:  # scale each row by the whole row, as one process would
        absmax = w_local.detach().float().abs().amax(dim=1, keepdim=True)  # [out, 1]
        torch.distributed.all_reduce(absmax, op=torch.distributed.ReduceOp.MAX, group=tp_group(weight))
    elif style == "rowwise" and w_local.shape[1] % config.group_size:
        raise IncompatibleOptionsError(
            f"int8 group_size={config.group_size} does not divide the tensor-parallel shard of {name} "
            f"({w_local.shape[1]} input features per rank)"
        )
    local_bias = local_tensor(bias) if style == "colwise" and bias is not None else None  # rowwise: added once
    try:
        inner = Int8Linear(quantize(w_local, config.group_size, absmax=absmax), local_bias, config.activations)
    except ValueError as err:  # W8A8 on a shard narrower than its groups
        raise IncompatibleOptionsError(f"{name} (tensor-parallel shard): {err}; use activations='float'") from None
    inner = inner.to(w_local.device)
    new: nn.Module = inner
    if style == "rowwise":
        new = TPRowwise(inner, None if bias is None else local_tensor(bias).detach(), tp_group(weight))
    parent, attr = parent_and_name(model, name)
    recorder.set_submodule(FEATURE, parent, attr, new, f"{style} shard -> int8")
    original = w_local.clone() if config.keep_original else None

    def free() -> None:
        w_local.set_(torch.empty(0, dtype=w_local.dtype, device=w_local.device))

    def restore() -> None:
        w_local.set_(original if original is not None else dequantize(inner.quantized, w_local.dtype))

    recorder.call(FEATURE, "float shard released" if original is None else "float shard kept", free, restore)


def can_tie_embedding(embed: nn.Module, backend: str = "native") -> bool:
    """Whether a tied LM head can be quantized with the embedding lookup reading the int8 matrix."""
    scale = getattr(embed, "embed_scale", None)
    return backend == "native" and (type(embed) is nn.Embedding or isinstance(scale, torch.Tensor))


def _tie_embedding(model: nn.Module, spec: ArchSpec, embed: nn.Module, head: Int8Linear, recorder: Recorder) -> None:
    scale = getattr(embed, "embed_scale", None)
    factor = None if scale is None else float(scale)
    lookup = Int8Embedding(head, embed.weight.dtype, getattr(embed, "padding_idx", None), factor)
    parent, attr = parent_and_name(model, spec.embed_tokens)
    recorder.set_submodule(FEATURE, parent, attr, lookup, "tied embedding -> int8")
