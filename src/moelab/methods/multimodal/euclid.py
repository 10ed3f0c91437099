"""The Euclidean twin of EEG-MoCE-lite: the same encoders and the same fusion shape, with
dot-product cross-attention and a linear head instead of the Lorentz stack [I].

Mirror of :class:`~moelab.methods.multimodal.model.HyperbolicMoCE`, layer for layer::

    per modality:  h = ConvEncoder(x); h / ‖h‖ per step; ELU; mean-pool windows; flatten
    L × { z = EuclideanCrossAttention(z); z = LayerNorm(z) }
    fused = mean_m(z_m) → Linear → Linear head → logits

:class:`EuclideanCrossAttention` is ordinary scaled dot-product attention
(``softmax(q·kᵀ/√D')`` with the diagonal masked, heads averaged as the hyperbolic layer merges
its heads by a midpoint), so it has no temperature or prior to tie to a curvature.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError
from moelab.methods.multimodal.config import EEGMoCEConfig
from moelab.methods.multimodal.model import make_encoder


class EuclideanCrossAttention(nn.Module):
    """Multi-head cross-attention among M modality vectors, each attending only to the others.

    ``forward(x [B, M, D]) → (y [B, M, D'], attn [B, H, M, M])``; ``y_i`` is the mean over
    heads of ``Σ_j a_ij v_j`` with ``a_i = softmax_j≠i(q_i·c_j / √D')``.

    Raises:
        InvalidValueError: fewer than 2 modalities.
    """

    def __init__(self, in_features: int, out_features: int, num_heads: int) -> None:
        super().__init__()
        self.q = nn.ModuleList(nn.Linear(in_features, out_features) for _ in range(num_heads))
        self.k = nn.ModuleList(nn.Linear(in_features, out_features) for _ in range(num_heads))
        self.v = nn.ModuleList(nn.Linear(in_features, out_features) for _ in range(num_heads))
        self.scale = 1.0 / math.sqrt(out_features)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        M = x.shape[1]
        if M < 2:
            raise InvalidValueError(f"cross-attention needs >= 2 modalities, got {M}")
        diag = torch.eye(M, dtype=torch.bool, device=x.device)
        outs, attns = [], []
        for wq, wk, wv in zip(self.q, self.k, self.v, strict=True):
            scores = wq(x) @ wk(x).transpose(-1, -2) * self.scale
            attn = scores.masked_fill(diag, float("-inf")).softmax(-1)
            outs.append(attn @ wv(x))
            attns.append(attn)
        return torch.stack(outs).mean(0), torch.stack(attns, dim=1)


class EuclideanTwin(nn.Module):
    """The Euclidean twin (see the module docstring).

    ``forward({m: [B, C_m, L_m]}) → (logits [B, num_classes], attn [L, B, H, M, M])``, float64.
    """

    def __init__(self, channels: dict[str, int], num_classes: int, config: EEGMoCEConfig):
        super().__init__()
        self.modalities = list(channels)
        self.pool = config.pool
        self.encoders = nn.ModuleDict({m: make_encoder(c, config) for m, c in channels.items()})
        width = (config.steps // config.pool) * config.filters
        self.attention = nn.ModuleList()
        self.norms = nn.ModuleList()
        for i in range(config.fusion_layers):
            self.attention.append(
                EuclideanCrossAttention(
                    width if i == 0 else config.fusion_hidden,
                    config.fusion_hidden,
                    config.fusion_heads,
                )
            )
            self.norms.append(nn.LayerNorm(config.fusion_hidden))
        self.out_proj = nn.Linear(config.fusion_hidden, config.fusion_hidden)
        self.head = nn.Linear(config.fusion_hidden, num_classes)
        self.double()

    def _encode(self, m: str, x: Tensor) -> Tensor:
        h = self.encoders[m](x)
        h = F.elu(h / (h.norm(dim=-1, keepdim=True) + 1e-8))
        B, S, D = h.shape
        n = S // self.pool
        return h[:, : n * self.pool].reshape(B, n, self.pool, D).mean(2).reshape(B, n * D)

    def forward(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        x = torch.stack([self._encode(m, inputs[m]) for m in self.modalities], dim=1)
        layers = []
        for attn, norm in zip(self.attention, self.norms, strict=True):
            x, a = attn(x)
            x = norm(x)
            layers.append(a)
        return self.head(self.out_proj(x.mean(1))), torch.stack(layers)
