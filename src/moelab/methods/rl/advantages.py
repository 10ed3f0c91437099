"""Advantage estimators: GiGPO (episode + anchor-state groups), GRPO, and GAE.

GiGPO (Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training", arXiv
2505.10978), as verl-agent's ``core_gigpo.py`` computes it [C]:

* episode advantage ``A^E``: each episode's return normalised within its group (the rollouts of
  one task instance): ``(R − mean)/(std + 1e-6)`` (``mean_std``) or ``R − mean`` (``mean``); std
  is the unbiased one (``torch.std``); a singleton group keeps ``R`` (mean 0, std 1);
* step advantage ``A^S``: the discounted return from each step ``G_t = Σ_k γ^k r_{t+k}``,
  normalised within its anchor-state group (equal anchor states within one instance group); a
  singleton step group gives 0 (its own mean, std 1);
* ``A = A^E + ω·A^S``.

GRPO is ``A^E`` alone. GAE (Schulman et al., arXiv 1506.02438) is the spec's fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.errors import InvalidValueError

EPS = 1e-6


def _check_norm(norm: str) -> None:
    if norm not in ("mean_std", "mean"):
        raise InvalidValueError(f"norm: must be 'mean_std' or 'mean', got {norm!r}")


def group_normalise(values: Tensor, groups: Tensor, norm: str, *, singleton_mean: bool) -> Tensor:
    """Normalise ``values [N]`` within groups ``groups [N]`` (int64 ids).

    Args:
        norm: ``"mean_std"``: ``(v − mean)/(std + 1e-6)``, unbiased std; ``"mean"``: ``v − mean``.
        singleton_mean: a one-member group's mean is its own value (step groups) when True,
            0 when False (episode groups); its std is 1 either way [C].
    Raises:
        InvalidValueError: shapes disagree or an unknown ``norm``.
    """
    _check_norm(norm)
    if values.shape != groups.shape or values.dim() != 1:
        raise InvalidValueError(
            f"values, groups: must be 1-D of one length, got {tuple(values.shape)}, "
            f"{tuple(groups.shape)}"
        )
    _, inv, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    v = values.double()
    n = counts.double()
    total = torch.zeros(len(counts), dtype=v.dtype).index_add_(0, inv, v)
    mean = total / n
    sq = torch.zeros(len(counts), dtype=v.dtype).index_add_(0, inv, (v - mean[inv]) ** 2)
    std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.ones_like(n))
    if not singleton_mean:
        mean = torch.where(n > 1, mean, torch.zeros_like(mean))
    out = v - mean[inv]
    if norm == "mean_std":
        out = out / (std[inv] + EPS)
    return out.to(values.dtype)


def discounted_returns(rewards: Tensor, episode: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + γ G_{t+1}`` within each episode (``episode [T]`` ids, steps contiguous)."""
    out = torch.zeros_like(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        if t == len(rewards) - 1 or episode[t + 1] != episode[t]:
            running = 0.0
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def gigpo_advantages(
    rewards: Tensor,
    episode: Tensor,
    episode_group: Tensor,
    anchor: Tensor,
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm: str = "mean_std",
) -> Tensor:
    """GiGPO's ``A^E + ω·A^S`` per step (``step_weight = 0``: GRPO).

    Args:
        rewards: ``[T]`` float32 per-step rewards, each episode's steps contiguous.
        episode: ``[T]`` int64 episode id of each step (0..N−1).
        episode_group: ``[N]`` int64 instance group of each episode.
        anchor: ``[T]`` int64 anchor-state id of each step, unique across instance groups.
    Returns:
        ``[T]`` float32 advantages.
    Raises:
        InvalidValueError: shapes disagree, an episode id outside ``[0, N)``, bad ``norm``.
    """
    T = rewards.shape[0]
    if episode.shape != (T,) or anchor.shape != (T,):
        raise InvalidValueError(
            f"rewards, episode, anchor: must be [T], got {tuple(rewards.shape)}, "
            f"{tuple(episode.shape)}, {tuple(anchor.shape)}"
        )
    N = episode_group.shape[0]
    if T and (int(episode.min()) < 0 or int(episode.max()) >= N):
        raise InvalidValueError(f"episode: ids must lie in [0, {N}) (one group per episode)")
    returns = torch.zeros(N, dtype=rewards.dtype).index_add_(0, episode, rewards)
    a_e = group_normalise(returns, episode_group, norm, singleton_mean=False)[episode]
    if step_weight == 0:
        return a_e
    g = discounted_returns(rewards, episode, gamma)
    a_s = group_normalise(g, anchor, norm, singleton_mean=True)
    return a_e + step_weight * a_s


def gae_advantages(
    rewards: Tensor, values: Tensor, episode: Tensor, terminal: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE(γ, λ) per step and the value targets ``A + V``.

    Args:
        rewards, values: ``[T]`` float32; episode: ``[T]`` ids, steps contiguous.
        terminal: ``[T]`` bool, True where the episode ended by termination (no bootstrap);
            an episode's last step that was truncated bootstraps from 0 too [I] (its next
            observation is not stored).
    Returns:
        ``(advantages [T], returns [T])``.
    """
    adv = torch.zeros_like(rewards)
    last = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        end = t == len(rewards) - 1 or episode[t + 1] != episode[t] or bool(terminal[t])
        next_v = 0.0 if end else float(values[t + 1])
        last = 0.0 if end else last
        delta = float(rewards[t]) + gamma * next_v - float(values[t])
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values
