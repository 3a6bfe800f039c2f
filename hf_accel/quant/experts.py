"""Int8 experts of a mixture-of-experts layer, for a self-speculative draft.

Transformers keeps a MoE layer's experts as two 3-D parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
run by its experts implementation. :class:`Int8Experts` holds them as one :class:`~hf_accel.quant.linear.Int8Linear`
per expert and projection (row scales; the decode-row kernel on the CPU) and takes the same call as Transformers'
module. The int8 feature itself leaves experts in float (docs/int8.md); the self-speculative int8 draft quantizes its
own, so it reads a quarter of the experts' bytes of the target it drafts for.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.registry import ArchSpec, experts_modules, parent_and_name
from .core import quantize
from .linear import Int8Linear

__all__ = ["Int8Experts", "quantize_experts"]

#: the storage Transformers' experts modules declare (``use_experts_implementation``) that :class:`Int8Experts` reads
LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}


class Int8Experts(nn.Module):
    """A mixture of experts with int8 weights: ``down(act(gate(x)) * up(x))`` per chosen expert, weighted, summed.

    Args:
        experts: Transformers' experts module (read, not modified): ``gate_up_proj [E, 2I, H]`` ([gate; up]
            concatenated), ``down_proj [E, H, I]``, ``act_fn``.

    Raises:
        TypeError: the module stores its experts another way (biases, transposed or interleaved weights, no gate).

    Shapes:
        ``hidden [T, H]``, ``top_k_index [T, k]`` (expert ids), ``top_k_weights [T, k]`` -> ``[T, H]``.
    """

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        layout = {name: getattr(experts, name, default) for name, default in LAYOUT.items()}
        if layout != LAYOUT:
            raise TypeError(f"{type(experts).__name__} stores its experts as {layout}; Int8Experts reads {LAYOUT}")
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
        self.num_experts = gate_up.shape[0]
        self.gate_up = nn.ModuleList(Int8Linear(quantize(w, None)) for w in gate_up)  # each [2I, H]
        self.down = nn.ModuleList(Int8Linear(quantize(w, None)) for w in down)  # each [H, I]
        self.act_fn = experts.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)  # [T, H]
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts)[: self.num_experts].tolist()  # one host read
        tokens = order // k  # [T * k] the token of each sorted pair
        weights = top_k_weights.reshape(-1)[order]  # [T * k]
        start = 0
        for expert, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]  # [n]
                gate, up = self.gate_up[expert](hidden[rows]).chunk(2, dim=-1)  # each [n, I]
                y = self.down[expert](self.act_fn(gate) * up) * weights[start : start + n, None]  # [n, H]
                out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out


def quantize_experts(model: nn.Module, spec: ArchSpec) -> int:
    """Replace every MoE layer's experts module of ``model`` by an :class:`Int8Experts` (on the experts' device), in
    place and unrecorded: for a private copy such as a self-speculative draft. Returns how many were replaced."""
    targets = {id(module) for module in experts_modules(model, spec)}
    names = [name for name, module in model.named_modules() if id(module) in targets]
    for name in names:  # e.g. model.layers.1.mlp.experts
        parent, attr = parent_and_name(model, name)
        experts = getattr(parent, attr)
        setattr(parent, attr, Int8Experts(experts).to(experts.gate_up_proj.device))
    return len(names)
