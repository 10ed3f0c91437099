"""Hyperbolic experts: a per-modality encoder lifted onto its own learnable-curvature
Lorentz manifold, and the Lorentz layers that act on such points.

EEG-MoCE (Zhou et al., "EEG-Based Multimodal Learning via Hyperbolic Mixture-of-Curvature
Experts", ICML 2026, arXiv 2604.12579; authors' code zhourunhe/EEG-MoCE,
``nets/HMultimodalNet.py``) gives each modality one always-active expert: a Euclidean encoder,
then a hyperbolic stack on that modality's manifold ``k_m`` (lift, Lorentz ELU, centroid
pooling, flatten). These experts fit moelab's :class:`~moelab.core.experts.bank.ExpertBank`
seam weakly and do not use it: they are heterogeneous (each modality has its own channel count,
length and manifold), the routing is fixed (modality m → expert m, no router, no top-k), and
the mixture is an attention over the experts' outputs
(:mod:`moelab.core.experts.curvature_attention`), not a weighted sum of expert rows.

Layers (all float64 in the recipe; ``k`` is passed to ``forward`` because the fusion manifold's
``k`` is recomputed on every call):

* :class:`HypLinear` — Hypformer's linear layer (Yang et al., KDD 2024) as the authors run it:
  ``nn.Linear(D+1 → D')`` on the **full** Lorentz vector, time included; time recomputed.
* :class:`HypLayerNorm` — LayerNorm on the space part, time recomputed.
* :class:`LorentzMLR` — Bdeir et al.'s Lorentz multinomial logistic regression (ICLR 2024).
* :class:`LorentzExpert` — encoder → L2-normalise each step → ``projx(pad(h))`` on its own
  ``geoopt.Lorentz(k, learnable)`` → Lorentz ELU → centroid pool → flatten.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.experts.lorentz import (
    add_time,
    centroid_pool,
    geoopt_lorentz,
    lorentz_elu,
    lorentz_flatten,
)
from moelab.errors import InvalidValueError


class HypLinear(nn.Module):
    """``x ↦ (√(‖s‖² + k), s)`` with ``s = W x + b``, ``W`` acting on all ``D+1`` coordinates.

    Init as the authors': Xavier-uniform with gain √2, zero bias.
    Shapes: ``[..., in_features+1] → [..., out_features+1]``.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features + 1, out_features)
        nn.init.xavier_uniform_(self.linear.weight, gain=math.sqrt(2))
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor, k: Tensor) -> Tensor:
        return add_time(self.linear(x), k)


class HypLayerNorm(nn.Module):
    """LayerNorm of the space part, time recomputed: ``[..., D+1] → [..., D+1]``."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(features)

    def forward(self, x: Tensor, k: Tensor) -> Tensor:
        return add_time(self.norm(x[..., 1:]), k)


class LorentzMLR(nn.Module):
    """Lorentz multinomial logistic regression (Bdeir et al., ICLR 2024, eq. for the signed
    distance to a Lorentz hyperplane), the authors' ``LorentzMLR``.

    Per class c with parameters ``a_c`` (scalar) and ``z_c`` (``[D]``), ``r = 1/√k``::

        w_t = sinh(r a) ‖z‖,   w_s = cosh(r a) z,   β = √(‖w_s‖² − w_t²)
        α = −w_t x_0 + cosh(r a) ⟨x_s, z⟩
        logit = sign(α) · β · √k · |asinh(r α / β)|

    Shapes: ``x [..., D+1] → logits [..., C]``. Init: ``a, z ~ U(±1/√D)``.
    """

    def __init__(self, features: int, num_classes: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(features)
        self.a = nn.Parameter(torch.empty(num_classes).uniform_(-bound, bound))
        self.z = nn.Parameter(torch.empty(num_classes, features).uniform_(-bound, bound))

    def forward(self, x: Tensor, k: Tensor) -> Tensor:
        r = 1.0 / k.sqrt()
        norm_z = self.z.norm(dim=-1)
        w_t = torch.sinh(r * self.a) * norm_z
        w_s = torch.cosh(r * self.a).unsqueeze(-1) * self.z
        beta = ((w_s * w_s).sum(-1) - w_t**2).sqrt()
        alpha = -w_t * x[..., :1] + torch.cosh(r * self.a) * (x[..., 1:] @ self.z.T)
        return torch.sign(alpha) * beta * k.sqrt() * torch.asinh(r * alpha / beta).abs()


class LorentzExpert(nn.Module):
    """One modality's expert: a Euclidean encoder, then a hyperbolic stack on its own manifold.

    Args:
        encoder: module mapping the modality's input to ``[B, S, D]`` (S steps, D features).
        k: initial Lorentz parameter (authors: 0.5; curvature ``−1/k``).
        learnable: train ``k`` (False: the fixed-curvature ablation).
        pool: centroid-pool window over the S steps (the output has ``S // pool`` steps).

    ``forward(x) → [B, 1 + (S // pool)·D]``, float64 points on ``self.manifold``; gradient
    reaches ``k`` through ``projx``, the ELU's time, the pooling and the flatten.
    """

    def __init__(self, encoder: nn.Module, k: float, learnable: bool, pool: int) -> None:
        super().__init__()
        if pool < 1:
            raise InvalidValueError(f"pool: must be >= 1, got {pool}")
        self.encoder = encoder
        self.manifold = geoopt_lorentz(k, learnable)
        self.pool = pool

    @property
    def k(self) -> Tensor:
        """The manifold's ``k`` (0-d parameter)."""
        return self.manifold.k

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(x)
        h = h / (h.norm(dim=-1, keepdim=True) + 1e-8)
        h = self.manifold.projx(F.pad(h, (1, 0)))
        h = lorentz_elu(h, self.k)
        h = centroid_pool(h, self.k, self.pool)
        return lorentz_flatten(h, self.k)
