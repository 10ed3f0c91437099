"""The routed expert bank: E feed-forward experts stored as stacked weights.

SwiGLU experts (Shazeer 2020, as Mixtral/Qwen/DeepSeek): ``y = (silu(x·W_g) ⊙ x·W_u)·W_d`` with
the gate and up projections fused into ``w_gate_up [E, D, 2F]`` (gate block first, then up —
the transformers v5 ``gate_up_proj`` order); GELU-MLP experts: ``y = gelu(x·W_u)·W_d``.
Weights are stored input-major (``[E, in, out]``) so each expert's matmul reads contiguous memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.config import ExpertsConfig
from moelab.core.experts.grouped_mm import grouped_mm


def expert_activation(kind: str, h: Tensor) -> Tensor:
    """The experts' activation on the first matmul's output: ``silu(gate) ⊙ up`` on
    ``[.., 2F]`` for ``"swiglu"``, exact (erf) ``gelu`` on ``[.., F]`` for ``"gelu"``."""
    if kind == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


class ExpertBank(nn.Module):
    """E experts computed on rows sorted by expert.

    Parameters:
        w_gate_up: ``[E, D, 2F]`` (swiglu) or w_up ``[E, D, F]`` (gelu).
        w_down: ``[E, F, D]``.
    """

    def __init__(self, config: ExpertsConfig, num_experts: int, backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.num_experts = num_experts
        self.backend = backend
        E, D, Fh = num_experts, config.hidden_size, config.ffn_hidden_size
        width = 2 * Fh if config.activation == "swiglu" else Fh
        name = "w_gate_up" if config.activation == "swiglu" else "w_up"
        self.register_parameter(name, nn.Parameter(torch.empty(E, D, width)))
        self.w_down = nn.Parameter(torch.empty(E, Fh, D))
        nn.init.normal_(self.w_in, std=config.init_std)
        nn.init.normal_(self.w_down, std=config.init_std)

    @property
    def w_in(self) -> nn.Parameter:
        """The input projection (``w_gate_up`` or ``w_up``)."""
        return self.w_gate_up if self.config.activation == "swiglu" else self.w_up

    def activation(self, h: Tensor) -> Tensor:
        """``silu(gate) ⊙ up`` on ``[.., 2F]`` for swiglu, exact (erf) ``gelu`` for gelu."""
        return expert_activation(self.config.activation, h)

    def forward(
        self, x_ND: Tensor, counts: Tensor, return_activations: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply expert e to its block of rows.

        Args:
            x_ND: ``[N, D]`` rows sorted by expert, in the weights' dtype.
            counts: ``[E]`` int64 rows per expert (sums to N).
            return_activations: also return the intermediate activations ``[N, F]``
                (``silu(gate) ⊙ up`` for swiglu, ``gelu(up)`` for gelu), row-aligned with
                ``x_ND`` (the specialization loss reads them; no extra compute).
        Returns:
            ``[N, D]`` expert outputs in the same order, or ``(outputs, activations)``.
        """
        h = grouped_mm(x_ND, self.w_in, counts, self.backend)
        a = self.activation(h)
        y = grouped_mm(a, self.w_down, counts, self.backend)
        return (y, a) if return_activations else y

    def expert_output(self, x_TD: Tensor, expert: int) -> Tensor:
        """Output of one expert on all tokens ``[T, D]`` (analysis: expert redundancy)."""
        return self.activation(x_TD @ self.w_in[expert]) @ self.w_down[expert]


class SharedExpert(nn.Module):
    """An always-on dense SwiGLU expert (DeepSeekMoE; Qwen2-MoE adds a sigmoid gate).

    ``y = g(x) · (silu(x·W_g) ⊙ x·W_u)·W_d`` with ``g(x) = sigmoid(x·w_gate)`` when gated, else 1.
    """

    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, gated: bool, init_std: float
    ) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(hidden_size, 2 * ffn_hidden_size))
        self.w_down = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size))
        self.gate = nn.Parameter(torch.empty(1, hidden_size)) if gated else None
        for p in self.parameters():
            nn.init.normal_(p, std=init_std)

    def forward(self, x_TD: Tensor) -> Tensor:
        gate, up = (x_TD @ self.w_gate_up).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ self.w_down
        if self.gate is not None:
            y = torch.sigmoid(F.linear(x_TD, self.gate)) * y
        return y
