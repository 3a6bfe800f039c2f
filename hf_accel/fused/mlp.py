"""A gated MLP with the gate and up projections fused into one matrix multiply.

``down(act(gate(x)) * up(x))`` becomes ``down(act(g) * u)`` with ``[g, u] = x @ [W_gate; W_up]^T``: one
read of the activations for both projections and one kernel launch instead of two. The fused weight is a
single tensor whose two halves *are* the original ``gate_proj``/``up_proj`` parameters (views, no copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FusedGatedMLP"]


class FusedGatedMLP(nn.Module):
    """Gated MLP computing ``down(act(gate) * up)`` from one fused ``[gate; up]`` projection.

    Args:
        gate_up_weight: ``[2 * I, H]`` fused weight, gate rows first.
        gate_up_bias: ``[2 * I]`` fused bias or ``None``.
        down_proj: the ``I -> H`` projection (shared with the original module).
        act_fn: the activation module (shared with the original module).

    Shapes:
        input ``[..., H]`` -> output ``[..., H]``.
    """

    def __init__(
        self,
        gate_up_weight: nn.Parameter,
        gate_up_bias: nn.Parameter | None,
        down_proj: nn.Module,
        act_fn: nn.Module,
    ) -> None:
        super().__init__()
        if gate_up_weight.dim() != 2 or gate_up_weight.shape[0] % 2:
            raise ValueError(f"gate_up_weight must be [2*I, H], got {tuple(gate_up_weight.shape)}")
        self.intermediate_size = gate_up_weight.shape[0] // 2
        # an nn.Linear around the shared fused parameters, so weight packing treats it like any projection
        rows, cols = gate_up_weight.shape
        self.gate_up_proj = nn.Linear(cols, rows, bias=gate_up_bias is not None, device="meta")
        self.gate_up_proj.weight = gate_up_weight
        if gate_up_bias is not None:
            self.gate_up_proj.bias = gate_up_bias
        self.down_proj = down_proj
        self.act_fn = act_fn
        self._compiled: object | None = None  # set by the compile feature: a torch.compile'd ``_mlp``
        #: original parameters that are views of rows ``[start, stop)`` of the fused weight (set by the adapter),
        #: so code that re-lays the fused weight out can re-point them too.
        self.weight_aliases: list[tuple[nn.Parameter, int, int]] = []
        #: the module's own gate / up attribute names when it replaced separate projections: state dicts then hold
        #: those keys (the unpatched model's checkpoint layout); ``None`` keeps ``gate_up_proj`` (Phi-3's own)
        self.split_names: tuple[str, str] | None = None
        self.register_state_dict_post_hook(_split_state)
        self.register_load_state_dict_pre_hook(_join_state)

    #: MLP attribute layouts of the registry's architectures: (gate, up, fused gate_up, down, activation)
    LAYOUTS: tuple[tuple[str | None, str | None, str | None, str, str], ...] = (
        ("gate_proj", "up_proj", None, "down_proj", "act_fn"),  # Llama, Mistral, Qwen, Gemma, OLMo 2, Granite
        (None, None, "gate_up_proj", "down_proj", "activation_fn"),  # Phi-3
    )

    @classmethod
    def from_module(cls, mlp: nn.Module, spec: Any = None, share: bool = True) -> FusedGatedMLP:
        """A fused equivalent of a gated MLP module (the activation is the module's own: SiLU, GELU-tanh, ...).

        Args:
            mlp: a gated MLP with ``gate``/``up``/``down`` projections and an activation module.
            spec: where its parts are (an :class:`hf_accel.core.registry.ArchSpec`); ``None`` recognises every
                registry architecture's layout by attribute names.
            share: make the original gate/up parameters views into the fused weight, so the weights exist once
                in memory (values unchanged); ``False`` leaves the original untouched and copies them.

        Returns:
            The fused module; it shares ``down_proj`` and the activation with ``mlp``.

        Raises:
            TypeError: ``mlp`` does not have a known gated-MLP layout.

        Side effects:
            With ``share``, ``mlp``'s gate/up parameters are re-pointed (their values stay bitwise the same).
        """
        gate_name, up_name, fused_name, down_name, act_name = cls._layout(mlp, spec)
        down, act = getattr(mlp, down_name), getattr(mlp, act_name)
        if fused_name is not None:  # already fused upstream (Phi-3): share the parameter as is
            gate_up = getattr(mlp, fused_name)
            return cls(gate_up.weight, gate_up.bias, down, act)
        gate, up = getattr(mlp, gate_name), getattr(mlp, up_name)
        weight, bias = cls.fuse_weights(gate, up)
        fused = cls(weight, bias, down, act)
        fused.split_names = (gate_name, up_name)
        rows = gate.weight.shape[0]
        fused.weight_aliases = [(gate.weight, 0, rows), (up.weight, rows, 2 * rows)]
        if share:
            gate.weight.data, up.weight.data = weight.data[:rows], weight.data[rows:]
            if bias is not None:
                gate.bias.data, up.bias.data = bias.data[:rows], bias.data[rows:]
        return fused

    @classmethod
    def _layout(cls, mlp: nn.Module, spec: Any) -> tuple[str | None, str | None, str | None, str, str]:
        if spec is not None:
            return spec.gate_proj, spec.up_proj, spec.gate_up_proj, spec.down_proj, spec.act_fn
        for layout in cls.LAYOUTS:
            if all(name is None or hasattr(mlp, name) for name in layout):
                return layout
        raise TypeError(
            f"{type(mlp).__name__} is not a gated MLP hf_accel knows: expected attributes "
            + " or ".join("/".join(n for n in layout if n) for layout in cls.LAYOUTS)
        )

    @classmethod
    def fuse_weights(cls, gate: nn.Linear, up: nn.Linear) -> tuple[nn.Parameter, nn.Parameter | None]:
        """Concatenate two projections' weights (and biases) into fresh ``[2I, H]`` / ``[2I]`` parameters."""
        if gate.weight.shape != up.weight.shape:
            raise ValueError(f"gate {tuple(gate.weight.shape)} and up {tuple(up.weight.shape)} differ in shape")
        if (gate.bias is None) != (up.bias is None):
            raise ValueError("gate and up projections must both have a bias or both have none")
        weight = nn.Parameter(torch.cat([gate.weight.detach(), up.weight.detach()], dim=0), requires_grad=False)
        bias = None
        if gate.bias is not None:
            bias = nn.Parameter(torch.cat([gate.bias.detach(), up.bias.detach()]), requires_grad=False)
        return weight, bias

    @property
    def gate_up_weight(self) -> torch.Tensor:
        """The fused ``[2I, H]`` weight (dense, whatever layout the projection keeps it in)."""
        proj = self.gate_up_proj
        return proj.weight if isinstance(proj, nn.Linear) else proj.dense_weight()

    @property
    def gate_up_bias(self) -> torch.Tensor | None:
        return self.gate_up_proj.bias

    def set_compiled(self, fn: object | None) -> None:
        """Route decode steps (``[B, 1, H]`` inputs) through ``fn``; ``None`` removes it.

        Prefill and multi-token chunks (speculative verification) stay eager, so prompt lengths and draft
        lengths never trigger recompilation: one graph per batch size.
        """
        self._compiled = fn

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H] -> gate_up: [..., 2I]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # each [..., I]
        return self.down_proj(self.act_fn(gate) * up)  # [..., H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._compiled is not None and x.dim() == 3 and x.shape[1] == 1:
            return self._compiled(x)  # decode: [B, 1, H], compiled once per batch size
        return self._mlp(x)

    def extra_repr(self) -> str:
        hidden = self.gate_up_proj.in_features
        return f"hidden={hidden}, intermediate={self.intermediate_size}, compiled={self._compiled is not None}"


def _split_state(module: FusedGatedMLP, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` post-hook: ``gate_up_proj.{weight,bias}`` -> the replaced projections' keys (views)."""
    if module.split_names is None:
        return
    rows = module.intermediate_size
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}gate_up_proj.{kind}", None)
        if fused is not None:
            gate, up = module.split_names
            state[f"{prefix}{gate}.{kind}"], state[f"{prefix}{up}.{kind}"] = fused[:rows], fused[rows:]


def _join_state(module: FusedGatedMLP, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the replaced projections' keys -> one ``gate_up_proj`` entry (a mismatch in
    shape is then reported by PyTorch under that key)."""
    if module.split_names is None:
        return
    gate, up = module.split_names
    for kind in ("weight", "bias"):
        g, u = f"{prefix}{gate}.{kind}", f"{prefix}{up}.{kind}"
        if g in state and u in state:
            state[f"{prefix}gate_up_proj.{kind}"] = torch.cat([state.pop(g), state.pop(u)], dim=0)
