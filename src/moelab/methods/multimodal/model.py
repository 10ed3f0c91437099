"""EEG-MoCE-lite: per-modality hyperbolic experts fused by curvature-aware cross-attention.

The authors' ``HMultimodalNet`` (zhourunhe/EEG-MoCE, ``nets/HMultimodalNet.py``) at the
research spec's size (``wave3-science.md`` §1.3), float64::

    per modality m:  LorentzExpert_m(x_m)            on its own manifold k_m (learnable)
    k_f = harmonic mean of the k_m                   (recomputed every forward, detached) [C]
    z_m = project_curvature(·, k_m → k_f, clamp 10)  [C]
    L × { z = CurvatureAwareCrossAttention(z); z = HypLayerNorm(z) }   prior in layer 1 [C]
    fused = midpoint_m(z_m) → HypLinear → LorentzMLR → logits                 [C]

Arms (:class:`~moelab.methods.multimodal.config.EEGMoCEConfig`): ``fixed_k`` freezes every
``k_m`` at ``k_init`` (then ``k_f = k_init`` and the projection is the identity);
``no_caf`` drops the curvature-scaled temperatures and the prior; ``unimodal_hyp`` keeps
modality A only (its point goes straight to the HypLinear and the MLR, fixed k). Not built
[I]: the authors' Lorentz domain batch norm inside each stack (GyroBN-style; its learnable scale
is unused and its curvature a by-value copy, so it sends no gradient to k), the temporal
Transformers of the audio/video encoders.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.core.experts.curvature_attention import CurvatureAwareCrossAttention
from moelab.core.experts.hyperbolic import HypLayerNorm, HypLinear, LorentzExpert, LorentzMLR
from moelab.core.experts.lorentz import (
    geoopt_lorentz,
    harmonic_mean_k,
    midpoint,
    project_curvature,
)
from moelab.methods.multimodal.config import EEGMoCEConfig
from moelab.methods.multimodal.encoder import ConvEncoder


def make_encoder(channels: int, config: EEGMoCEConfig) -> ConvEncoder:
    """The per-modality encoder of ``config`` for ``channels`` input channels."""
    return ConvEncoder(
        channels,
        config.filters,
        config.kernel,
        config.depthwise_kernel,
        config.steps,
        config.dropout,
    )


class HyperbolicMoCE(nn.Module):
    """EEG-MoCE-lite and its hyperbolic ablations (see the module docstring).

    Args:
        channels: ``{modality: input channels}`` in fusion order (one modality: unimodal).
        num_classes: classes of the MLR.
        config: the arm and sizes (``arm`` in moce, fixed_k, no_caf, unimodal_hyp).

    ``forward({m: [B, C_m, L_m]}) → (logits [B, num_classes], attn [L, B, H, M, M] or None)``,
    float64.
    """

    def __init__(self, channels: dict[str, int], num_classes: int, config: EEGMoCEConfig):
        super().__init__()
        learnable = config.arm in ("moce", "no_caf")
        self.modalities = list(channels)
        self.max_radius = config.max_radius
        self.experts = nn.ModuleDict(
            {
                m: LorentzExpert(make_encoder(c, config), config.k_init, learnable, config.pool)
                for m, c in channels.items()
            }
        )
        self.fusion = geoopt_lorentz(config.k_init, learnable=False)
        width = (config.steps // config.pool) * config.filters
        self.attention = nn.ModuleList()
        self.norms = nn.ModuleList()
        if len(channels) > 1:
            for i in range(config.fusion_layers):
                self.attention.append(
                    CurvatureAwareCrossAttention(
                        width if i == 0 else config.fusion_hidden,
                        config.fusion_hidden,
                        config.fusion_heads,
                        curvature_aware=config.arm != "no_caf",
                        use_prior=i == 0,
                        prior_init=config.prior_init,
                    )
                )
                self.norms.append(HypLayerNorm(config.fusion_hidden))
            width = config.fusion_hidden
        self.out_proj = HypLinear(width, config.fusion_hidden)
        self.mlr = LorentzMLR(config.fusion_hidden, num_classes)
        self.double()

    def curvatures(self) -> dict[str, float]:
        """``{modality: k_m}`` (the curvature is ``−1/k_m``)."""
        return {m: float(e.k.detach()) for m, e in self.experts.items()}

    def forward(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        feats = [self.experts[m](inputs[m]) for m in self.modalities]
        ks = [self.experts[m].k for m in self.modalities]
        k_f = harmonic_mean_k(ks)
        with torch.no_grad():
            self.fusion.k.copy_(k_f)
        points = [
            project_curvature(f, self.experts[m].manifold, self.fusion, self.max_radius)
            for m, f in zip(self.modalities, feats, strict=True)
        ]
        attns = None
        if len(points) == 1:
            fused = points[0]
        else:
            x = torch.stack(points, dim=1)
            k_stack = torch.stack(ks)
            layers = []
            for attn, norm in zip(self.attention, self.norms, strict=True):
                x, a = attn(x, k_f, k_stack)
                x = norm(x, k_f)
                layers.append(a)
            attns = torch.stack(layers)
            fused = midpoint(x, k_f)
        return self.mlr(self.out_proj(fused, k_f), k_f), attns
