"""The authors' regression baseline ``SimpleMLP`` (``models/baseline_models.py``): per cell,
``Linear → LN → ReLU → Linear → LN → ReLU → Linear`` from the condition straight to the genes,
trained with MSE. Here it sees the same condition as the flow (view and tissue one-hot; the
authors' sees the image embedding only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SimpleMLP(nn.Module):
    """``[..., C] → [..., G]`` with two hidden layers of width ``hidden``."""

    def __init__(self, in_size: int, hidden: int, out_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_size, hidden),
            nn.LayerNorm(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
            nn.ReLU(),
            nn.Linear(hidden, out_size),
        )

    def forward(self, condition: Tensor) -> Tensor:
        return self.net(condition)


def condition_features(view: Tensor, tissue: Tensor, num_tissues: int) -> Tensor:
    """``[B, P, V + K]``: each cell's view and its slide's tissue one-hot."""
    B, P, _ = view.shape
    code = F.one_hot(tissue, num_tissues).to(view.dtype)[:, None, :].expand(B, P, num_tissues)
    return torch.cat([view, code], dim=-1)
