"""PPO-clip with a KL term to a reference policy (no critic unless GAE is used).

``L = −mean min(ρA, clip(ρ, 1−ε, 1+ε)A) + β·KL_k3(π‖π_ref) − c_H·H(π)`` with
``ρ = exp(log π − log π_old)`` (Schulman et al., arXiv 1707.06347) and the k3 estimator
``KL ≈ exp(log π_ref − log π) − (log π_ref − log π) − 1`` (verl's ``low_var_kl`` [C];
Schulman's "Approximating KL divergence" note), as in GiGPO's scripts (β = 0.01).
"""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_clip_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, clip: float) -> Tensor:
    """``−mean min(ρA, clip(ρ, 1−ε, 1+ε)A)`` over ``[B]`` steps (advantages are constants)."""
    ratio = (logp - logp_old.detach()).exp()
    adv = advantages.detach()
    return -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()


def k3_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Mean k3 estimate of ``KL(π‖π_ref)`` from the sampled actions' log-probs ``[B]``
    (non-negative per sample; the reference is a constant)."""
    d = logp_ref.detach() - logp
    return (d.exp() - d - 1).mean()
