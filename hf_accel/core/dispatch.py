"""Where a module's weights live and run: accelerate dispatch and Transformers tensor parallelism.

hf_accel does not distribute models itself; it keeps working on models that ``accelerate`` dispatched
(``device_map`` over several devices, CPU/disk offload) or that Transformers sharded (``tp_plan="auto"`` under
``torchrun``). This module answers, for the feature adapters:

* is a module's weight *offloaded* (accelerate keeps it on the ``meta`` device and loads it per call), and on
  which device does the module *execute* (its hook's ``execution_device``);
* does a replaced module carry an accelerate hook that its replacement must keep;
* is a weight a tensor-parallel shard (a ``DTensor``), with which plan style (``colwise`` / ``rowwise`` ...),
  and what is this rank's local part.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import torch
from torch import nn

from .errors import IncompatibleOptionsError

__all__ = [
    "TPRowwise",
    "check_resident",
    "execution_device",
    "is_offloaded",
    "is_sharded",
    "local_tensor",
    "model_dtype",
    "tp_size",
    "tp_style",
    "transfer_hook",
]


# --------------------------------------------------------------------------------------- accelerate
def is_offloaded(module: nn.Module) -> bool:
    """Whether any weight of ``module`` is offloaded by accelerate (held on ``meta``, loaded per call)."""
    return any(p.device.type == "meta" for p in module.parameters())


def _hooks(module: nn.Module) -> list[Any]:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", [hook]))  # a SequentialHook holds several


def execution_device(module: nn.Module) -> torch.device | None:
    """The device ``module`` computes on: its (or a submodule's) accelerate hook's, else its first tensor's."""
    for sub in module.modules():
        for hook in _hooks(sub):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "meta":
            return tensor.device
    return None


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes in: its first floating-point parameter's (``float32`` if it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def check_resident(name: str, module: nn.Module, feature: str, advice: str) -> None:
    """Raise when ``module``'s weights are offloaded: ``feature`` cannot rewrite weights that are not there.

    Raises:
        IncompatibleOptionsError: naming the module, where it executes and what to do.
    """
    if is_offloaded(module):
        device = execution_device(module)
        raise IncompatibleOptionsError(
            f"{feature} cannot rewrite {name}: accelerate offloads its weights (they are on the meta device and "
            f"loaded onto {device} per call); {advice}"
        )


def transfer_hook(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` the accelerate hook of the module it replaces (device alignment of inputs and outputs).

    Only non-offloading hooks can be shared: an offloading hook loads weights by the *old* module's names.
    """
    hook = getattr(old, "_hf_hook", None)
    if hook is None:
        return
    if any(getattr(h, "offload", False) for h in _hooks(old)):
        raise IncompatibleOptionsError(
            f"cannot replace {type(old).__name__}: its accelerate hook offloads weights by name"
        )
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(new, hook)


# ------------------------------------------------------------------------------------ tensor parallel
def tp_size(model: nn.Module) -> int:
    """Tensor-parallel degree Transformers sharded ``model`` with (1 when it did not)."""
    return int(getattr(model, "_tp_size", None) or 1)


def is_sharded(tensor: torch.Tensor | None) -> bool:
    if tensor is None:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether Transformers sharded ``model`` by tensor parallelism (a degree above 1, or ``DTensor`` weights)."""
    return tp_size(model) > 1 or any(is_sharded(p) for p in model.parameters())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a ``DTensor`` (the tensor itself otherwise)."""
    return tensor._local_tensor if is_sharded(tensor) else tensor


def tp_style(model: nn.Module, name: str) -> str | None:
    """The tensor-parallel plan style Transformers applied to module ``name`` (``None``: not in the plan)."""
    plan = getattr(model, "_tp_plan", None) or {}
    generic = re.sub(r"\.\d+\.", ".*.", name)
    for pattern, style in plan.items():
        if pattern in (name, generic) or fnmatch.fnmatchcase(name, pattern):
            return style
    return None


class TPRowwise(nn.Module):
    """A row-wise tensor-parallel projection around a local module: partial output, all-reduce, bias once.

    Args:
        inner: computes this rank's partial product from its input shard (no bias).
        bias: the replicated bias, or ``None``.
        group: the tensor-parallel process group.

    Shapes:
        input ``[..., in_features / tp]`` (this rank's shard) -> output ``[..., out_features]`` (replicated).
    """

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group: Any) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias, persistent=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def tp_group(tensor: torch.Tensor) -> Any:
    """The tensor-parallel process group a ``DTensor`` is sharded over."""
    mesh = tensor.device_mesh
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
