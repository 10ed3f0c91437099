"""Dense SwiGLU feed-forward network (Shazeer 2020, arXiv 2002.05202), Llama layout."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from moelab.models.linear import Linear


class SwiGLUFFN(nn.Module):
    """``y = W_down(silu(W_gate x) ⊙ W_up x)``, no biases.

    Weights (``nn.Linear`` layout): ``w_gate``, ``w_up`` ``[F, D]``; ``w_down`` ``[D, F]``.
    Parameters: ``3·D·F``. The MoE expert bank stores the same maths as
    ``w_gate_up [E, D, 2F]`` (gate block first) and ``w_down [E, F, D]``, i.e. transposed.

    Shapes: ``x [..., D]`` → ``[..., D]``.
    """

    def __init__(self, d_model: int, ffn_hidden_size: int) -> None:
        super().__init__()
        if d_model < 1 or ffn_hidden_size < 1:
            raise ValueError(
                f"d_model, ffn_hidden_size: must be >= 1, got {d_model}, {ffn_hidden_size}"
            )
        self.w_gate = Linear(d_model, ffn_hidden_size, bias=False)
        self.w_up = Linear(d_model, ffn_hidden_size, bias=False)
        self.w_down = Linear(ffn_hidden_size, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
