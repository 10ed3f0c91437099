"""The per-modality Euclidean encoder of EEG-MoCE-lite (``wave3-science.md`` §1.3).

A compact EEGNet-style stack, the same for every modality and every arm (only the input
channel count differs)::

    Conv1d(C → F, kernel, same) → BN → ELU → dropout
    depthwise Conv1d(F, depthwise_kernel, same) → Conv1d 1×1 (F → F) → BN → ELU
    AdaptiveAvgPool1d(S) → [B, S, F]

This project's lite version [I] of the authors' ``EEGEncoder`` (a 2-D EEGNet with a spatial
depthwise conv, ``nets/HMultimodalNet.py``): the tri-modal set's inputs differ in channel count
(6, 28, 1), so the spatial mixing is the first conv's.
"""

from __future__ import annotations

from torch import Tensor, nn


class ConvEncoder(nn.Module):
    """``[B, C, L] → [B, steps, filters]`` (see the module docstring)."""

    def __init__(
        self,
        channels: int,
        filters: int = 16,
        kernel: int = 15,
        depthwise_kernel: int = 7,
        steps: int = 16,
        dropout: float = 0.25,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(channels, filters, kernel, padding="same", bias=False),
            nn.BatchNorm1d(filters),
            nn.ELU(),
            nn.Dropout(dropout),
            nn.Conv1d(
                filters, filters, depthwise_kernel, padding="same", groups=filters, bias=False
            ),
            nn.Conv1d(filters, filters, 1, bias=False),
            nn.BatchNorm1d(filters),
            nn.ELU(),
            nn.AdaptiveAvgPool1d(steps),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).transpose(1, 2)
