"""Every native entry point of hf_accel, as a torch custom op, and the one place implementations are chosen.

Each :class:`OpSpec` names an op's schema, its pure-torch reference (:mod:`.reference`), a fake (shapes only, for
tracing), and the function of the CPU extension (:mod:`.build`) that implements it, with the constraints each
instruction-set build puts on its arguments, and its device-generic implementation for accelerators
(:mod:`.portable`).
:func:`choose` picks, for a device and those arguments, the widest native build that takes them on the CPU, the
portable implementation on other devices, else the reference, and says why each other candidate does not run:
features record the choice at patch time and ``patch_report`` shows it. Nothing falls back silently.

:func:`op` defines ``torch.ops.hf_accel.<name>`` on first use (never at import): its CPU implementation is the
chosen native function (the reference where none applies), CUDA runs the op's Triton kernel or portable
implementation where it has one, every other device the reference, and the fake serves ``torch.compile``, which
keeps the op opaque. Eager hot paths call :attr:`Choice.fn` directly (the same function, without the dispatcher's few
microseconds per call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import build, portable, reference, triton_experts, triton_int8, triton_paged
from .build import ISAS, extension, extension_status

__all__ = ["OPS", "Choice", "OpSpec", "choose", "define_composite", "native_builds", "op", "reset_choices"]

_ALL = tuple(ISAS)  # widest first
_AVX512 = ("avx512vnni", "avx512")


def _no_fit(isa: str, needs: dict[str, Any]) -> str | None:
    return None


def _int8_fit(isa: str, needs: dict[str, Any]) -> str | None:
    lanes = 16 if isa in _AVX512 else 8
    group = needs.get("group_size")
    if group is not None and group % lanes:
        return f"int8 groups of {group} are not a multiple of its {lanes} lanes"
    return None


def _int_dot_fit(isa: str, needs: dict[str, Any]) -> str | None:
    groups, k = needs.get("groups", 1), needs.get("in_features")
    if groups != 1:
        return f"it needs one weight scale per row, got {groups}"
    if k is not None and k % reference.ACT_BLOCK:
        return f"in_features {k} is not a multiple of {reference.ACT_BLOCK}"
    return None


def _paged_fit(isa: str, needs: dict[str, Any]) -> str | None:
    dtype, block, dim = needs.get("dtype"), needs.get("block_size"), needs.get("head_dim")
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"it takes float32 / bfloat16 / float16 pools, got {dtype}"
    if block is not None and block > 64:
        return f"blocks of {block} tokens exceed its 64"
    if dim is not None and dim % 8:
        return f"head_dim {dim} is not a multiple of 8"
    return None


def _panel_fit(isa: str, needs: dict[str, Any]) -> str | None:
    dtype, n = needs.get("dtype"), needs.get("out_features")
    if dtype is not None and dtype != torch.float32:
        return f"it is float32 only, got {dtype}"
    if n is not None and n % 16:
        return f"out_features {n} is not a multiple of 16"
    return None


def _half_fit(isa: str, needs: dict[str, Any]) -> str | None:
    lanes = 16 if isa in _AVX512 else 8
    dtype, k = needs.get("dtype"), needs.get("in_features")
    if dtype is not None and dtype not in reference.HALF_DTYPES:
        return f"it takes bfloat16 / float16 weights, got {dtype}"
    if k is not None and k % lanes:
        return f"in_features {k} is not a multiple of its {lanes} lanes"
    return None


def _decoder_fit(isa: str, needs: dict[str, Any]) -> str | None:
    return _int8_fit(isa, {"group_size": needs.get("group_size")})


@dataclass(frozen=True)
class OpSpec:
    """One native entry point.

    Args:
        name: ``torch.ops.hf_accel.<name>``.
        schema: its arguments and results (``torch.library`` syntax).
        reference: the pure-torch implementation (any device).
        fake: shapes only, for tracing; ``None`` for ops ``torch.compile`` never sees.
        native: the CPU extension's function name (``None``: reference only).
        builds: the instruction-set builds that have it, widest first.
        fits: ``fits(isa, needs)``: why that build cannot take arguments with these properties (``None``: it can).
        needs: ``needs(*args)``: the properties of a call's arguments :attr:`fits` looks at (for the op's dispatch).
        portable: the device-generic implementation (:mod:`.portable`: whole-batch, no host sync) that devices
            without a native build run (CUDA, XPU, MPS); ``None``: they run the reference.
        triton: the op's Triton module for CUDA (``load()`` -> its launcher, or ``None`` and why not; ``WHY``; and
            ``PORTABLE_WHY_NOT``, what it does better than :attr:`portable`), preferred over
            :attr:`portable` on CUDA where it loads).
    """

    name: str
    schema: str
    reference: Callable[..., Any]
    fake: Callable[..., Any] | None
    native: str | None
    builds: tuple[str, ...] = _ALL
    fits: Callable[[str, dict[str, Any]], str | None] = _no_fit
    needs: Callable[..., dict[str, Any]] = field(default=lambda *args: {})
    portable: Callable[..., Any] | None = None
    triton: Any = None


def _rows_by_out(x: torch.Tensor, weight: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _experts_fake(x: torch.Tensor, expert_ids: torch.Tensor, qweight: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty((*expert_ids.shape, qweight.shape[1]))


def _activations_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((m, 16)), x.new_empty((m, 16), dtype=torch.int32)


def _attention_fake(query: torch.Tensor, *rest: Any) -> torch.Tensor:
    b, h, q, d = query.shape
    return query.new_empty((b, q, h, d))


def _panel_linear_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0] * packed.shape[2]))


def _pack_fake(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    return weight.new_empty((n // 16, k, 16))


def _decoder_fake(h: torch.Tensor, *rest: Any) -> torch.Tensor:
    return torch.empty_like(h)


_LINEAR = "(Tensor x, Tensor qweight, Tensor scale) -> Tensor"
OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "int8_linear", _LINEAR, reference.int8_linear, _rows_by_out, "int8_linear", _ALL, _int8_fit,
            lambda x, q, s: {"group_size": q.shape[1] // s.shape[1]}, portable.int8_linear, triton_int8,
        ),
        OpSpec(
            "int8_experts_linear", "(Tensor x, Tensor expert_ids, Tensor qweight, Tensor scale) -> Tensor",
            reference.int8_experts_linear, _experts_fake, "int8_experts_linear", _ALL, _int8_fit,
            lambda x, i, q, s: {"group_size": q.shape[2] // s.shape[2]}, portable.int8_experts_linear, triton_experts,
        ),
        OpSpec(
            "w8a8_linear", _LINEAR, reference.w8a8_linear, _rows_by_out, "w8a8_linear", _ALL, _int_dot_fit,
            lambda x, q, s: {"groups": s.shape[1], "in_features": q.shape[1]},
        ),
        OpSpec(
            "w8a16_linear", _LINEAR, reference.w8a16_linear, _rows_by_out, "w8a16_linear", _ALL, _int_dot_fit,
            lambda x, q, s: {"groups": s.shape[1]},
        ),
        OpSpec(
            "quantize_activations", "(Tensor x) -> (Tensor, Tensor, Tensor)", reference.vnni_activations,
            _activations_fake, "quantize_activations", _ALL,
        ),
        OpSpec(
            "paged_attention",
            "(Tensor query, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor q_pos, float scale, int window, "
            "float softcap, Tensor? sinks=None) -> Tensor",
            reference.paged_attention, _attention_fake, "paged_attention", _ALL, _paged_fit,
            lambda q, k, *rest: {"dtype": q.dtype, "block_size": k.shape[1], "head_dim": q.shape[-1]},
            portable.paged_attention, triton_paged,
        ),
        OpSpec("panel_pack", "(Tensor weight) -> Tensor", reference.panel_pack, _pack_fake, "panel_pack"),
        OpSpec(
            "panel_linear", "(Tensor x, Tensor packed, Tensor? bias) -> Tensor", reference.panel_linear,
            _panel_linear_fake, "panel_linear", _ALL, _panel_fit,
        ),
        OpSpec(
            "float_linear", "(Tensor x, Tensor weight) -> Tensor", reference.float_linear, _rows_by_out,
            "float_linear",
        ),
        OpSpec(
            "half_linear", "(Tensor x, Tensor weight) -> Tensor", reference.half_linear, _rows_by_out, "half_linear",
            _ALL, _half_fit, lambda x, w: {"dtype": w.dtype, "in_features": w.shape[1]},
        ),
        OpSpec(
            "coded_linear", "(Tensor x, Tensor codes, Tensor params) -> Tensor", reference.coded_linear,
            _rows_by_out, "coded_linear",
        ),
        OpSpec(
            "decoder_layers",
            "(Tensor h, Tensor[] flat, Tensor(a!)[] keys, Tensor(b!)[] values, int used, Tensor allowed, Tensor cos, "
            "Tensor sin, int heads, int kv_heads, float eps, float scaling, int mode) -> Tensor",
            reference.decoder_layers, _decoder_fake, "decoder_layers", _ALL, _decoder_fit,
        ),
        OpSpec(
            "decoder_layers_paged",
            "(Tensor h, Tensor[] flat, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor slots, "
            "Tensor block_tables, Tensor q_pos, Tensor cos, Tensor sin, int heads, int kv_heads, float eps, "
            "float scaling, int mode) -> Tensor",
            reference.decoder_layers_paged, _decoder_fake, "decoder_layers_paged", _ALL, _decoder_fit,
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """Which implementation of an op runs for some device and arguments, and why.

    Args:
        op: the op's name.
        impl: ``"cpu/<isa>"`` (a native build), ``"<device>/portable"`` (:mod:`.portable` on an accelerator) or
            ``"reference"``.
        fn: the implementation itself (the native function, or the reference).
        why: why this one.
        rejected: each other candidate -> why it does not run.
    """

    op: str
    impl: str
    fn: Callable[..., Any] = field(repr=False)
    why: str
    rejected: dict[str, str]

    @property
    def native(self) -> bool:
        """Whether an implementation made for speed runs (a native build, or the portable one on an accelerator), not
        the reference or a fallback path."""
        return self.impl != "reference" and "/" in self.impl

    def describe(self) -> dict[str, Any]:
        """``{"uses": impl, "why": ..., "not": {other: why not}}`` (what ``patch_report`` lists)."""
        return {"uses": self.impl, "why": self.why, "not": dict(self.rejected)}


_choices: dict[tuple[Any, ...], Choice] = {}
_choices_lock = threading.Lock()


def _key(name: str, device: torch.device, needs: dict[str, Any]) -> tuple[Any, ...]:
    return (name, device.type, tuple(sorted((k, str(v)) for k, v in needs.items())))


def _build_reason(isa: str, spec: OpSpec, needs: dict[str, Any]) -> str | None:
    lacks = build.cpu_lacks(isa)
    if lacks is not None:
        return lacks
    misfit = spec.fits(isa, needs)
    if misfit is not None:
        return misfit
    module = extension(isa)
    if module is None:
        return extension_status(isa)
    return None if hasattr(module, spec.native) else f"the {isa} build has no {spec.native}"


def _triton_choice(spec: OpSpec, device: torch.device, rejected: dict[str, str]) -> Choice | None:
    """The op's Triton kernel on CUDA (recording why not in ``rejected`` where it cannot run)."""
    if spec.triton is None:
        return None
    if device.type != "cuda":
        rejected["cuda/triton"] = f"a CUDA kernel; this call is on {device.type}"
        return None
    fn, why = spec.triton.load()
    if fn is None:
        rejected["cuda/triton"] = str(why)
        return None
    return Choice(spec.name, "cuda/triton", fn, spec.triton.WHY,
                  {**rejected, "cuda/portable": spec.triton.PORTABLE_WHY_NOT,
                   "reference": "written to be plainly right, not fast"})  # fmt: skip


def choose(name: str, device: torch.device | str = "cpu", **needs: Any) -> Choice:
    """The implementation of op ``name`` for ``device`` and arguments with properties ``needs`` (the keys its
    :attr:`OpSpec.fits` reads: ``group_size``, ``dtype``, ``block_size``...). Cached per process.

    Raises:
        KeyError: an unknown op.
    """
    spec = OPS[name]
    device = torch.device(device)
    key = _key(name, device, needs)
    with _choices_lock:
        cached = _choices.get(key)
    if cached is not None:
        return cached
    rejected: dict[str, str] = {}
    choice = None
    if device.type != "cpu":
        rejected["cpu/*"] = f"native builds are CPU code; this call is on {device.type}"
        choice = _triton_choice(spec, device, rejected)
        if choice is None and spec.portable is not None:
            choice = Choice(name, f"{device.type}/portable", spec.portable, portable.WHY[name],
                            {**rejected, "reference": "written to be plainly right, not fast"})  # fmt: skip
    elif spec.native is not None:
        for isa in spec.builds:
            why = _build_reason(isa, spec, needs)
            if why is not None:
                rejected[f"cpu/{isa}"] = why
                continue
            fn = getattr(extension(isa), spec.native)
            choice = Choice(name, f"cpu/{isa}", fn, "the widest native build this CPU runs that takes these arguments",
                            {**rejected, "reference": "a native build runs here"})  # fmt: skip
            break
    if choice is None:
        choice = Choice(name, "reference", spec.reference, "no native implementation takes this call", rejected)
    with _choices_lock:
        _choices[key] = choice
    return choice


def native_builds(name: str) -> dict[str, Callable[..., Any] | None]:
    """Every build of op ``name`` that exists on this machine -> its function (``None`` where the CPU lacks it or the
    build does not have it): for tests that hold each build to the reference."""
    spec = OPS[name]
    out: dict[str, Callable[..., Any] | None] = {}
    for isa in spec.builds:
        module = extension(isa) if build.cpu_lacks(isa) is None else None
        out[isa] = getattr(module, spec.native, None) if module is not None and spec.native else None
    return out


_defined: dict[str, Any] = {}
_libraries: list[torch.library.Library] = []
_define_lock = threading.Lock()


def _cpu_impl(spec: OpSpec) -> Callable[..., Any]:
    def cpu(*args: Any) -> Any:
        return choose(spec.name, "cpu", **spec.needs(*args)).fn(*args)

    return cpu


def _cuda_impl(spec: OpSpec) -> Callable[..., Any]:
    def cuda(*args: Any) -> Any:
        return choose(spec.name, args[0].device, **spec.needs(*args)).fn(*args)

    return cuda


def op(name: str) -> Any:
    """``torch.ops.hf_accel.<name>``, defined once per process on first use (thread-safe; never at import)."""
    defined = _defined.get(name)
    if defined is not None:
        return defined
    with _define_lock:
        if name not in _defined:
            spec = OPS[name]
            lib = torch.library.Library("hf_accel", "FRAGMENT")
            lib.define(name + spec.schema)
            lib.impl(name, spec.reference, "CompositeExplicitAutograd")
            if spec.native is not None:
                lib.impl(name, _cpu_impl(spec), "CPU")
            if spec.portable is not None or spec.triton is not None:
                lib.impl(name, _cuda_impl(spec), "CUDA")
            if spec.fake is not None:
                torch.library.register_fake(f"hf_accel::{name}", spec.fake, lib=lib)
            _libraries.append(lib)
            _defined[name] = getattr(torch.ops.hf_accel, name)
    return _defined[name]


def define_composite(
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    dispatch: str = "CompositeExplicitAutograd",
) -> Any:
    """Define ``torch.ops.hf_accel.<name>`` for a feature's composite step (e.g. a pool write plus attention, or a
    pre-packed linear) that calls the ops above inside: ``torch.compile`` keeps it opaque. Once per process."""
    with _define_lock:
        if name not in _defined:
            lib = torch.library.Library("hf_accel", "FRAGMENT")
            lib.define(name + schema)
            lib.impl(name, impl, dispatch)
            torch.library.register_fake(f"hf_accel::{name}", fake, lib=lib)
            _libraries.append(lib)
            _defined[name] = getattr(torch.ops.hf_accel, name)
    return _defined[name]


def reset_choices() -> None:
    """Forget every choice made so far (tests that simulate a CPU without some build patch
    :func:`hf_accel.kernels.build.cpu_lacks`, then call this before and after)."""
    with _choices_lock:
        _choices.clear()
