"""PA-MoE's phase router: one expert per environment step from observation, goal and history.

Paper: Yang et al., "Phase-Aware Mixture of Experts for Agentic Reinforcement Learning",
ICML 2026, arXiv 2602.17038. The authors' released training path never calls a router
(``shared/research/wave3-agents-alignment.md`` §1.2); this follows the architecture of their
unused ``PaperCompliantPhaseRouter`` [C], which matches the paper's wording:

* observation tokens cross-attend to the goal (mission) tokens (multi-head attention),
  mean-pooled over the observation [C];
* an LSTM over the features of the last few steps [C];
* ``[concat] → Linear → LayerNorm → ReLU → Dropout → Linear → E logits`` [C];
* ``p_t = softmax(ℓ_t / τ_k)`` with τ annealed linearly from 2.0 to 0.5 [C]; a sampled expert in
  training, the argmax in evaluation [C].

Sizes are this project's CPU choice [I] (the paper code's: 512 wide, a 3-layer LSTM of 256).
The router does not touch the experts: :func:`step_plan` turns its per-step choices into a
:class:`~moelab.core.plan.RoutingPlan` for ``MoELayer.forward(x, plan=...)``, weight 1 per step,
so the router learns only from its own objective (REINFORCE, :mod:`moelab.core.losses.phase`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.plan import RoutingPlan
from moelab.errors import InvalidValueError


def linear_temperature(step: int, start: float = 2.0, end: float = 0.5, steps: int = 3000) -> float:
    """``τ_k = τ0 − (τ0 − τf)·min(k/K, 1)``: the router temperature after ``step`` updates.

    Args:
        step: router updates so far (k >= 0).
        start, end: τ0 and τf (> 0; the paper code's 2.0 and 0.5).
        steps: K >= 1, the updates over which τ falls (paper code: 3000).
    Raises:
        InvalidValueError: a negative step, K < 1 or a temperature <= 0.
    """
    if step < 0:
        raise InvalidValueError(f"step: must be >= 0, got {step}")
    if steps < 1:
        raise InvalidValueError(f"steps: must be >= 1, got {steps}")
    if not (start > 0 and end > 0):
        raise InvalidValueError(f"start, end: temperatures must be > 0, got {start}, {end}")
    return start - (start - end) * min(step / steps, 1.0)


def sample_experts(
    logits_BE: Tensor,
    temperature: float,
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick one expert per row of ``logits_BE`` ``[B, E]``.

    Training samples ``e ~ Cat(softmax(ℓ/τ))``; evaluation (``greedy``) takes the argmax, which
    does not depend on τ.

    Returns:
        ``(expert_idx [B] int64, log_prob [B] float32)``: the choice and its log-probability
        under ``softmax(ℓ/τ)`` (differentiable w.r.t. the logits).
    Raises:
        InvalidValueError: ``temperature`` <= 0 or ``logits_BE`` not 2-D.
    """
    if logits_BE.dim() != 2:
        raise InvalidValueError(f"logits_BE: must be [B, E], got {tuple(logits_BE.shape)}")
    if not temperature > 0:
        raise InvalidValueError(f"temperature: must be > 0, got {temperature}")
    logp = F.log_softmax(logits_BE.float() / temperature, dim=-1)
    if greedy:
        idx = logp.argmax(-1)
    else:
        idx = torch.multinomial(logp.detach().exp(), 1, generator=generator).squeeze(-1)
    return idx, logp.gather(-1, idx[:, None]).squeeze(-1)


def step_plan(expert_idx: Tensor, logits_TE: Tensor) -> RoutingPlan:
    """A routing plan with exactly one expert per token (one token = one environment step).

    Args:
        expert_idx: ``[T]`` int64 in ``[0, E)``.
        logits_TE: ``[T, E]`` the router's logits (kept for telemetry and balance losses).
    Returns:
        Pairs ``(t, expert_idx[t], 1.0)`` for t = 0..T−1 (token-major, ``top_k = 1``).
    Raises:
        InvalidValueError: shapes disagree or an id lies outside ``[0, E)``.
    """
    if logits_TE.dim() != 2 or expert_idx.shape != (logits_TE.shape[0],):
        raise InvalidValueError(
            f"expert_idx [T] and logits_TE [T, E] disagree: {tuple(expert_idx.shape)}, "
            f"{tuple(logits_TE.shape)}"
        )
    E = logits_TE.shape[1]
    if expert_idx.numel() and (int(expert_idx.min()) < 0 or int(expert_idx.max()) >= E):
        raise InvalidValueError(f"expert_idx: ids must lie in [0, {E}), got {expert_idx.tolist()}")
    T = expert_idx.shape[0]
    logits = logits_TE.float()
    return RoutingPlan(
        token_idx=torch.arange(T, device=expert_idx.device),
        expert_idx=expert_idx.long(),
        weight=torch.ones(T, device=expert_idx.device),
        logits=logits,
        probs=logits.softmax(-1),
        num_experts=E,
        top_k=1,
    )


class PhaseRouter(nn.Module):
    """Observation ⊗ goal attention + step-history LSTM → expert logits ``[B, E]`` (float32).

    Args:
        obs_size: width of each observation token.
        goal_size: width of each goal token.
        history_size: width of each history step.
        num_experts: E.
        hidden_size: width of the attention, the LSTM and the MLP.
        num_heads: attention heads (must divide ``hidden_size``).
        lstm_layers: LSTM depth.
        dropout: before the output layer.
    Raises:
        InvalidValueError: a size < 1, ``num_heads`` not dividing ``hidden_size``, dropout
            outside ``[0, 1)``.
    """

    def __init__(
        self,
        obs_size: int,
        goal_size: int,
        history_size: int,
        num_experts: int,
        hidden_size: int = 64,
        num_heads: int = 4,
        lstm_layers: int = 1,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        sizes = dict(
            obs_size=obs_size,
            goal_size=goal_size,
            history_size=history_size,
            num_experts=num_experts,
            hidden_size=hidden_size,
            num_heads=num_heads,
            lstm_layers=lstm_layers,
        )
        for name, v in sizes.items():
            if not (isinstance(v, int) and v >= 1):
                raise InvalidValueError(f"{name}: must be an int >= 1, got {v!r}")
        if hidden_size % num_heads:
            raise InvalidValueError(
                f"num_heads: must divide hidden_size={hidden_size}, got {num_heads}"
            )
        if not 0.0 <= dropout < 1.0:
            raise InvalidValueError(f"dropout: must be in [0, 1), got {dropout}")
        self.num_experts = num_experts
        self.num_heads = num_heads
        self.q = nn.Linear(obs_size, hidden_size)
        self.kv = nn.Linear(goal_size, 2 * hidden_size)
        self.o = nn.Linear(hidden_size, hidden_size)
        self.lstm = nn.LSTM(history_size, hidden_size, lstm_layers, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(2 * hidden_size, hidden_size),
            nn.LayerNorm(hidden_size),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_size, num_experts),
        )

    def forward(
        self, obs_BND: Tensor, goal_BMD: Tensor, goal_mask_BM: Tensor, history_BHD: Tensor
    ) -> Tensor:
        """Logits ``[B, E]`` float32.

        Args:
            obs_BND: ``[B, N, obs_size]`` observation tokens (MiniGrid: the 49 view cells).
            goal_BMD: ``[B, M, goal_size]`` goal tokens (the mission's words).
            goal_mask_BM: ``[B, M]`` bool, True at real goal tokens (each row needs one).
            history_BHD: ``[B, H, history_size]`` the last H steps' features, oldest first
                (zeros before the episode's start).
        Raises:
            InvalidValueError: batch sizes disagree or a goal row has no real token.
        """
        B = obs_BND.shape[0]
        if goal_BMD.shape[0] != B or goal_mask_BM.shape != goal_BMD.shape[:2]:
            raise InvalidValueError(
                f"goal_BMD {tuple(goal_BMD.shape)} and goal_mask_BM "
                f"{tuple(goal_mask_BM.shape)} must match obs_BND's batch {B}"
            )
        if history_BHD.shape[0] != B:
            raise InvalidValueError(f"history_BHD: batch {history_BHD.shape[0]} != {B}")
        if not bool(goal_mask_BM.any(-1).all()):
            raise InvalidValueError("goal_mask_BM: every row needs at least one real goal token")
        _, (h_n, _) = self.lstm(history_BHD)
        feats = torch.cat([self._attend(obs_BND, goal_BMD, goal_mask_BM), h_n[-1]], dim=-1)
        return self.mlp(feats).float()

    def _attend(self, obs_BND: Tensor, goal_BMD: Tensor, goal_mask_BM: Tensor) -> Tensor:
        """Multi-head attention of the observation tokens (queries) over the goal tokens,
        mean-pooled over the observation: ``[B, hidden]``. Written out rather than
        ``nn.MultiheadAttention``: at these sizes its fused path costs several times more on
        CPU."""
        B, N, _ = obs_BND.shape
        nh = self.num_heads
        q = self.q(obs_BND).view(B, N, nh, -1).transpose(1, 2)  # [B, nh, N, dh]
        k, v = self.kv(goal_BMD).view(B, goal_BMD.shape[1], 2, nh, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, nh, N, M]
        scores = scores.masked_fill(~goal_mask_BM[:, None, None, :], float("-inf"))
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, N, -1)
        return self.o(ctx).mean(1)
