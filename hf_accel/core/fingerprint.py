"""A cheap fingerprint of a model's weights: what cached keys/values (a paged cache's prefix table) were computed
with, so a cache can tell that the weights changed since (``load_state_dict``, an optimizer step, an in-place edit,
unpatch / re-patch) and drop what it holds.

Every parameter and buffer contributes its storage pointer, its version counter (bumped by every in-place operation
autograd sees: ``copy_`` under ``no_grad``, optimizer steps, ``load_state_dict``), its shape and dtype, and a few
sampled values (writes through ``.data``, which bypass the version counter, are caught where they touch a sample).
A module holding weights that are neither (a packed layout) adds its own ``hf_accel_fingerprint()`` value.
Cost: one small gather per tensor and one device-to-host copy, about a millisecond for a 135M-parameter model.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

__all__ = ["sampled_values", "tensor_key", "tensor_version", "weights_fingerprint"]

_SAMPLES = 8  # values read from each tensor


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place operation autograd sees), or -1 for an inference tensor,
    which keeps none."""
    return -1 if t.is_inference() else t._version


def tensor_key(t: torch.Tensor) -> Hashable:
    """What a cache built from ``t`` is keyed on: its storage pointer and version counter; an inference tensor keeps no
    version counter, so its key holds a few sampled values instead (an in-place edit is seen where it touches one)."""
    version = tensor_version(t)
    if version >= 0:
        return (t.data_ptr(), version)
    return (t.data_ptr(), version, tuple(sampled_values(t).tolist()))


def sampled_values(t: torch.Tensor) -> torch.Tensor:
    """A few of ``t``'s values, evenly spaced over its elements, as float64 on its device (equal before and after a
    write that touches none of them): what catches writes that bypass the version counter."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return flat.new_zeros(0, dtype=torch.float64)
    step = max(1, flat.numel() // _SAMPLES)
    return flat[::step][:_SAMPLES].to(torch.float64)


@torch.no_grad()
def weights_fingerprint(model: nn.Module) -> Hashable:
    """A value that changes when ``model``'s parameters or buffers change (see the module docstring)."""
    meta: list[Hashable] = [
        (name, module.hf_accel_fingerprint())
        for name, module in model.named_modules()
        if callable(getattr(module, "hf_accel_fingerprint", None))
    ]
    samples = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.to_local() if callable(getattr(t, "to_local", None)) else t  # a DTensor (tensor parallel): its shard
        if t.device.type == "meta":
            meta.append((name, "meta"))
            continue
        meta.append((name, t.data_ptr(), tensor_version(t), tuple(t.shape), str(t.dtype)))  # inference: the samples
        samples.append(sampled_values(t).to("cpu", non_blocking=False))
    values = torch.cat(samples).tolist() if samples else []
    return (tuple(meta), tuple(values))
