"""Half-precision decode linears: where the native executor cannot serve a model because its weights are bfloat16 /
float16, the ``native`` feature still runs each decoder linear's decode rows (and the LM head's) through hf_accel's
``half_linear`` kernel (``kernels/cpu/half_gemm.cpp``: the weight read in place and widened in registers, float32
sums, one rounding to the model's dtype at the end, as PyTorch's own half-precision GEMMs do), and everything else
through the module's own ``F.linear``.

The forward is bound on each ``nn.Linear`` instance (recorded); the weight stays the module's parameter, so edits,
``load_state_dict`` and ``state_dict`` see the usual module.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.recorder import Recorder
from ..core.registry import decoder_linears, get_spec
from ..kernels.ops import Choice, choose
from ..kernels.reference import HALF_DTYPES, HALF_MAX_ROWS
from .layers import has_hooks

__all__ = ["HALF_DTYPES", "MAX_ROWS", "apply_half_linears", "half_unavailable"]

FEATURE = "native"
MAX_ROWS = HALF_MAX_ROWS  # activation rows the kernel takes (decode steps and short chunks); more go to F.linear
_KERNELS: dict[torch.dtype, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}  # the chosen build's, per dtype


def _choice(weight: torch.Tensor) -> Choice:
    return choose("half_linear", weight.device, dtype=weight.dtype, in_features=weight.shape[1])


def half_unavailable(model: nn.Module) -> str | None:
    """Why the half-precision decode linears cannot serve ``model`` (``None``: they can)."""
    targets = decoder_linears(model, get_spec(model))
    if not targets:
        return "no nn.Linear in the decoder layers"
    for name, linear in targets:
        weight = linear.weight
        if weight.dtype not in HALF_DTYPES or weight.device.type != "cpu":
            return f"{name} is {weight.dtype} on {weight.device.type} (half_linear takes bfloat16 / float16 on the CPU)"
        if has_hooks((linear,)):
            return f"{name} has forward hooks"
        choice = _choice(weight)
        if not choice.native:
            return f"{name}: " + "; ".join(dict.fromkeys(choice.rejected.values()))
    return None


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with decode rows through ``half_linear``. ``x [..., K]`` -> ``[..., N]``."""
    weight, bias = self.weight, self.bias
    rows = x.numel() // max(1, x.shape[-1])
    kernel = _KERNELS.get(weight.dtype)  # a model cast to float32 since: no kernel, F.linear
    fast = x.dtype == weight.dtype and x.is_cpu and rows <= MAX_ROWS and not torch.compiler.is_dynamo_compiling()
    if kernel is None or not fast or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    y = kernel(x.reshape(rows, -1).float(), weight)  # [M, N] float32 sums
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def apply_half_linears(model: nn.Module, recorder: Recorder) -> None:
    """Bind the half-precision decode forward on every decoder linear and the LM head (recorded); the caller checked
    :func:`half_unavailable`."""
    targets = decoder_linears(model, get_spec(model))
    choice = _choice(targets[0][1].weight)
    recorder.choose(FEATURE, "half_linear", choice.impl, choice.why, choice.rejected)
    for dtype in HALF_DTYPES:
        _KERNELS.setdefault(dtype, choice.fn)  # one function for both dtypes (it reads the weight's)
    for _, linear in targets:
        recorder.set_instance_attr(FEATURE, linear, "forward", types.MethodType(_forward, linear), "half decode rows")
