"""PA-MoE's router losses (arXiv 2602.17038): REINFORCE with a switching cost, a squared
balance loss, a switching surrogate and the expert-diversity loss.

The paper code's intended terms [C] (``paper_compliant_router.py``; see
``shared/research/wave3-agents-alignment.md`` §1.2-1.3): its switching penalty compares argmax
integers and has no gradient, and its diversity loss is never applied. Here the switching cost
acts on the router's advantage (:func:`switch_shaped_advantages`, this project's reading [I]),
and the diversity loss is computed as written and applied.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


def switch_shaped_advantages(
    advantages_T: Tensor, expert_idx_T: Tensor, episode_start_T: Tensor, cost: float
) -> Tensor:
    """``Â_t = A_t − cost·1[e_t ≠ e_{t−1}]``, no cost at an episode's first step [I].

    Args:
        advantages_T, expert_idx_T, episode_start_T: ``[T]`` steps in episode order (an
            episode's steps contiguous), ``episode_start_T`` bool True at each first step.
        cost: λ_s >= 0 (spec: 0.05).
    Raises:
        InvalidValueError: shapes disagree or ``cost`` < 0.
    """
    if not (advantages_T.shape == expert_idx_T.shape == episode_start_T.shape):
        raise InvalidValueError(
            "advantages_T, expert_idx_T, episode_start_T: shapes disagree: "
            f"{tuple(advantages_T.shape)}, {tuple(expert_idx_T.shape)}, "
            f"{tuple(episode_start_T.shape)}"
        )
    if cost < 0:
        raise InvalidValueError(f"cost: must be >= 0, got {cost}")
    switched = torch.zeros_like(episode_start_T)
    switched[1:] = expert_idx_T[1:] != expert_idx_T[:-1]
    switched &= ~episode_start_T
    return advantages_T - cost * switched.to(advantages_T.dtype)


def reinforce_loss(log_prob_T: Tensor, advantages_T: Tensor) -> Tensor:
    """``L_R = −mean_t log p_t(e_t)·Â_t`` (REINFORCE; the advantages are constants)."""
    return -(log_prob_T * advantages_T.detach()).mean()


def uniform_balance_loss(probs_TE: Tensor) -> Tensor:
    """``Σ_k (f̄_k − 1/E)²`` with ``f̄ = mean_t p_t`` (paper code, weight 0.001 [C]); 0 when
    the mean routing distribution is uniform."""
    E = probs_TE.shape[-1]
    return ((probs_TE.mean(0) - 1.0 / E) ** 2).sum()


def switching_probability(probs_TE: Tensor, same_episode_T: Tensor) -> Tensor:
    """Differentiable switching surrogate [I]: ``mean_t (1 − ⟨p_t, p_{t+1}⟩)``, the probability
    that two independent draws at consecutive steps differ, over the pairs (t, t+1) of one
    episode.

    Args:
        probs_TE: ``[T, E]`` routing distributions in episode order.
        same_episode_T: ``[T]`` bool, True where step t+1 continues step t's episode (the last
            entry is ignored).
    Returns:
        A scalar in [0, 1] (0 when there is no consecutive pair).
    """
    keep = same_episode_T[:-1]
    if not bool(keep.any()):
        return probs_TE.sum() * 0.0
    inner = (probs_TE[:-1] * probs_TE[1:]).sum(-1)
    return (1.0 - inner[keep]).mean()


def expert_diversity_loss(
    action_logp_EBA: Tensor, probs_BE: Tensor, threshold: float = 0.1
) -> Tensor:
    """The paper code's diversity loss [C]: over expert pairs i < j whose policies are closer
    than ``threshold`` on the batch's states, ``(τ − KL(π_i‖π_j))·mean_b(p_i p_j)``, averaged
    over those pairs (0 when none is that close).

    ``KL(π_i‖π_j)`` is the mean over states of ``Σ_a π_i(a) (log π_i(a) − log π_j(a))``.

    Args:
        action_logp_EBA: ``[E, B, A]`` log-probabilities of each expert's policy on B states.
        probs_BE: ``[B, E]`` the router's distributions on those states.
        threshold: τ_div > 0 (paper code: 0.1).
    Raises:
        InvalidValueError: shapes disagree or ``threshold`` <= 0.
    """
    E, B, _ = action_logp_EBA.shape
    if probs_BE.shape != (B, E):
        raise InvalidValueError(f"probs_BE: must be [B={B}, E={E}], got {tuple(probs_BE.shape)}")
    if not threshold > 0:
        raise InvalidValueError(f"threshold: must be > 0, got {threshold}")
    i, j = torch.triu_indices(E, E, offset=1, device=probs_BE.device)
    p_i = action_logp_EBA[i].exp()
    kl = (p_i * (action_logp_EBA[i] - action_logp_EBA[j])).sum(-1).mean(-1)  # [pairs]
    close = kl < threshold
    if not bool(close.any()):
        return probs_BE.sum() * 0.0
    overlap = (probs_BE[:, i] * probs_BE[:, j]).mean(0)
    return ((threshold - kl) * overlap)[close].mean()
