"""``PackedLinear``: a linear layer whose weight is pre-packed once for fast skinny products (CPU).

PyTorch's eager ``F.linear`` hands a plain row-major weight to MKL on every call; for the skinny products of
decoding (one or a few activation rows) MKL streams it at 15-16 GB/s on this machine. Two packed layouts:

* ``"panel"`` (fp32 on AVX2 / AVX-512 CPUs): hf_accel's own kernel (``kernels/cpu/panel_gemm.cpp``) over the weight in
  panels of 16 output features, ``[N/16, K, 16]``. Decode-sized products run 1.3-2.3x faster than oneDNN's
  packed GEMM here (``docs/compile.md``), larger ones on par; a plain strided tensor, so it deep-copies,
  and Inductor passes it through unchanged.
* ``"onednn"`` (otherwise): the weight re-ordered once for oneDNN's kernels (what Inductor's weight "freezing"
  does inside a compiled graph, done here per module, eagerly, so it also helps uncompiled code).

The values are the same fp32/bf16 numbers in another order (``dense_weight`` gives them back bitwise); results
differ from ``F.linear`` only by summation order. Inside ``torch.compile`` the call goes through a custom op
(``hf_accel::packed_linear``, defined on first use): Inductor cannot lower either kernel itself.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.fingerprint import tensor_version
from ..kernels.ops import Choice, choose, define_composite

__all__ = ["PackedLinear", "define_compiled_op", "packing_unavailable", "panel_choice", "unpack_linears"]

LAYOUTS = ("auto", "panel", "onednn")


def panel_choice(weight: torch.Tensor) -> Choice:
    """The panel GEMM's implementation for ``weight`` [N, K] (:func:`hf_accel.kernels.ops.choose`): the widest build,
    or the reference where it does not apply (then the weight is packed for oneDNN instead)."""
    return choose("panel_linear", weight.device, dtype=weight.dtype, out_features=weight.shape[0])


def _panel_unavailable(weight: torch.Tensor) -> str | None:
    choice = panel_choice(weight)
    return None if choice.native else "; ".join(dict.fromkeys(choice.rejected.values()))  # each reason once


def packing_unavailable(weight: torch.Tensor) -> str | None:
    """Why ``weight`` cannot be packed (``None`` when it can): CPU, fp32/bf16 (bf16 where oneDNN has bf16 kernels
    for this CPU), a oneDNN-enabled build."""
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type} (oneDNN packing is a CPU layout)"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {weight.dtype} (oneDNN packing takes float32 or bfloat16)"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if weight.dtype == torch.bfloat16 and not _onednn_bf16():
        return (
            f"bfloat16 on a CPU without oneDNN's bf16 kernels (they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; this CPU "
            f"has {torch.backends.cpu.get_cpu_capability()})"
        )
    return None


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN can pack and multiply bfloat16 weights on this CPU (AVX2-only CPUs cannot)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _panel_fn() -> Callable[..., torch.Tensor]:
    """The panel GEMM a panel-packed weight runs (it was packed only where :func:`panel_choice` is native)."""
    return choose("panel_linear", "cpu", dtype=torch.float32).fn


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    if packed.layout == torch._mkldnn:  # oneDNN's opaque layout
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if packed.dim() == 2:  # "dense": moved or cast where no packed layout applies
        return torch.nn.functional.linear(x, packed, bias)
    y = _panel_fn()(x.reshape(-1, x.shape[-1]), packed, bias)  # [M, N]
    return y.view(*x.shape[:-1], out_features)


def _packed_linear_fake(x, packed, bias, out_features):  # shapes only, for tracing
    return x.new_empty((*x.shape[:-1], out_features))


def define_compiled_op():
    """Define ``torch.ops.hf_accel.packed_linear`` once per process (Inductor treats it as an opaque kernel).

    Called by the compile feature before anything is compiled (never at import).
    """
    schema = "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor"
    return define_composite("packed_linear", schema, _packed_linear, _packed_linear_fake)


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held pre-packed for oneDNN (inference only, CPU).

    Args:
        packed: the weight in oneDNN's layout (from ``torch.ops.mkldnn._reorder_linear_weight``).
        bias: ``[N]`` or ``None``.
        in_features / out_features: ``K`` / ``N``.

    Shapes:
        input ``[..., K]`` of the weight's dtype -> output ``[..., N]``.
    """

    def __init__(self, packed: torch.Tensor, bias: nn.Parameter | None, in_features: int, out_features: int) -> None:
        super().__init__()
        self.packed = packed  # a plain attribute: opaque layout, not a state_dict entry
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features
        self.loads = 0  # weights loaded through load_state_dict since packing

    @property
    def layout(self) -> str:
        """``"panel"`` (hf_accel's AVX2 / AVX-512 kernel), ``"onednn"``, or ``"dense"`` (a plain ``[N, K]`` weight: the
        module was moved or cast where neither applies, e.g. to CUDA or float16; it then runs ``F.linear``)."""
        if self.packed.layout == torch._mkldnn:
            return "onednn"
        return "panel" if self.packed.dim() == 3 else "dense"

    @classmethod
    def from_module(cls, linear: nn.Linear, batch_hint: int = 1, layout: str = "auto") -> PackedLinear:
        """Pack ``linear``'s weight (the bias parameter is shared, not copied).

        Args:
            linear: a plain ``nn.Linear`` on CPU in float32/bfloat16.
            batch_hint: the activation rows oneDNN tunes its layout for (decode: the batch size).
            layout: ``"auto"`` (``"panel"`` where hf_accel's kernel runs this weight, else ``"onednn"``),
                ``"panel"`` or ``"onednn"``.

        Raises:
            TypeError: not an ``nn.Linear``.
            ValueError: the weight cannot be packed (device, dtype or build; the message says which), or the
                requested layout is not available for it.
        """
        if type(linear) is not nn.Linear:
            raise TypeError(f"PackedLinear.from_module needs an nn.Linear, got {type(linear).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        why = packing_unavailable(linear.weight)
        if why is not None:
            raise ValueError(f"cannot pack this linear: {why}")
        weight = linear.weight.detach()
        no_panel = _panel_unavailable(weight) if layout != "onednn" else "onednn requested"
        if layout == "panel" and no_panel is not None:
            raise ValueError(f"cannot pack this linear in panels: {no_panel}")
        if no_panel is None:
            packed = choose("panel_pack", "cpu").fn(weight)  # [N / 16, K, 16]
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        return cls(packed, linear.bias, linear.in_features, linear.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight in the usual layout (bitwise the values that were packed)."""
        if self.layout == "panel":
            return self.packed.transpose(1, 2).reshape(self.out_features, self.in_features)
        return self.packed if self.layout == "dense" else self.packed.to_dense()

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the same weight (a fresh dense tensor) and the same bias parameter."""
        weight = self.dense_weight()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear.to(dtype=weight.dtype)

    @staticmethod
    def _pack_like(weight: torch.Tensor, layout: str) -> torch.Tensor:
        if layout == "dense" or packing_unavailable(weight) is not None:
            return weight
        if layout == "panel" and _panel_unavailable(weight) is None:
            return choose("panel_pack", "cpu").fn(weight)  # [N / 16, K, 16]
        return torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> PackedLinear:
        """``model.to(...)`` / ``.half()`` / ``.cuda()`` reach the packed weight too: re-packed where a layout applies
        to the result, else kept dense (``layout == "dense"``)."""
        super()._apply(fn, recurse)
        dense = self.dense_weight()
        moved = fn(dense)
        if moved is not dense and (moved.dtype != dense.dtype or moved.device != dense.device):
            auto = "panel" if _panel_unavailable(moved) is None else "onednn"
            self.packed = self._pack_like(moved.detach().contiguous(), auto)
        return self

    # state dicts hold the dense weight under ``weight``, as the nn.Linear it replaced: checkpoints and
    # load_state_dict stay those of the unpatched model
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_weight().detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):  # type: ignore[no-untyped-def]
        key = prefix + "weight"
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing, unexpected, errors)
        if key not in state_dict:
            if strict:
                missing.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != (self.out_features, self.in_features):
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, the shape "
                f"in current model is {(self.out_features, self.in_features)}."
            )
            return
        with torch.no_grad():  # re-packed (a new packed tensor; the weights' fingerprint sees it)
            self.packed = self._pack_like(value.detach().to("cpu", self.packed.dtype).contiguous(), self.layout)
        self.loads += 1

    def hf_accel_fingerprint(self) -> tuple[int, int, int]:
        """What :func:`hf_accel.core.fingerprint.weights_fingerprint` adds for this module (it covers parameters and
        buffers; the packed weight is neither): loads, the packed tensor's identity and version (-1 for an inference
        tensor, packed under ``torch.inference_mode``: it keeps no counter)."""
        packed = self.packed
        return (self.loads, id(packed), tensor_version(packed))

    def __deepcopy__(self, memo: dict[int, object]) -> PackedLinear:
        # the opaque oneDNN tensor has no storage to copy: re-pack the dense values
        bias = copy.deepcopy(self.bias, memo)
        packed = self.packed.clone() if self.layout != "onednn" else self._pack_like(self.dense_weight(), "onednn")
        new = PackedLinear(packed, bias, self.in_features, self.out_features)
        new.train(self.training)
        memo[id(self)] = new
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout != "dense" and (x.dtype != self.packed.dtype or x.device.type != "cpu"):
            raise TypeError(f"PackedLinear holds a {self.packed.dtype} CPU weight; got a {x.dtype} input on {x.device}")
        bias = self.bias.detach() if self.bias is not None else None
        if torch.compiler.is_dynamo_compiling():  # the op exists: the compile feature defined it before compiling
            return torch.ops.hf_accel.packed_linear(x, self.packed, bias, self.out_features)
        return _packed_linear(x, self.packed, bias, self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"dtype={self.packed.dtype}, layout={self.layout}"
        )


def unpack_linears(model: nn.Module) -> int:
    """Replace every :class:`PackedLinear` under ``model`` by an equivalent ``nn.Linear`` (for copies that change
    dtype or get re-quantized). Returns how many were replaced."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                setattr(module, name, child.to_linear())
                count += 1
    return count
