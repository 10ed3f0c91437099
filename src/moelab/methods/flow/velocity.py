"""Velocity fields ``h [B, P, D] → v [B, P, L]``: MoLF's MoE, a dense twin, the authors'
attention head.

``h`` is the normalised velocity input ``LN([z_t, t, condition])`` of every cell ``p`` of every
slide ``b`` (:class:`~moelab.methods.flow.model.LatentFlow` builds it).

* :class:`MoEVelocity` (MoLF's ``MoEVelocityPredictor``): a moelab
  :class:`~moelab.core.layer.MoELayer` per cell: a linear router with N(0, σ²) logit noise in
  training, top-k on the logits then softmax over the k (``softmax_before_topk=False``),
  Switch balance loss in transformers' convention (f = count/T, computed from the noisy
  logits) without z-loss, and residual-MLP experts
  (:class:`~moelab.core.experts.residual.ResidualMLPExpertBank`), then a shared ``D → L``
  projection (equal to per-expert output projections: see that module). The authors' gate is
  ``nn.Linear`` with a bias; moelab's router has none (a difference of E numbers).
* :class:`DenseVelocity`: the same residual-MLP block as one expert that every cell uses,
  its feed-forward width chosen so its parameters match the MoE's *active* ones
  (:func:`matched_ffn_size`). With one expert and top-1, the MoE equals it.
* :class:`AttentionVelocity` (the authors' non-MoE ``AttentionVelocityHead``): one post-LN
  Transformer layer *across the cells of a slide* (no positional encoding), so this ablation
  changes more than MoE vs dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.experts.residual import ResidualMLPExpertBank, residual_expert_parameters
from moelab.core.layer import MoELayer
from moelab.core.telemetry import RoutingRecord


@dataclass
class FieldOutput:
    """A velocity field's output.

    Attributes:
        velocity: ``[B, P, L]``.
        aux_losses: float32 scalars (the MoE's ``"load_balance"`` in training), coefficients
            applied.
        record: the MoE's routing record (None for dense fields).
    """

    velocity: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    record: RoutingRecord | None = None


def matched_ffn_size(
    in_size: int, model_size: int, ffn_size: int, num_experts: int, top_k: int
) -> int:
    """Feed-forward width of a one-expert residual-MLP block whose parameters equal the MoE's
    active ones: ``top_k`` experts plus the router (``D·E``); the shared output projection
    is in both. One more unit of F adds ``2H + 1`` parameters."""
    active = top_k * residual_expert_parameters(in_size, model_size, ffn_size)
    active += in_size * num_experts
    base = residual_expert_parameters(in_size, model_size, 0)
    return max(1, round((active - base) / (2 * model_size + 1)))


class MoEVelocity(nn.Module):
    """MoLF's MoE velocity field (see the module docstring).

    Args:
        in_size: D, the velocity input width.
        out_size: L, the latent width.
        num_experts, top_k: E and k.
        model_size, ffn_size: the experts' block width H and feed-forward width F.
        dropout: inside the experts, in training.
        logit_noise_std: router logit noise σ in training (MoLF: 0.01).
        aux_loss_coeff: Switch balance-loss weight (0: no balance loss).
        init_std: normal init std of the router and expert weights.
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        *,
        num_experts: int = 6,
        top_k: int = 2,
        model_size: int = 64,
        ffn_size: int = 512,
        dropout: float = 0.0,
        logit_noise_std: float = 0.01,
        aux_loss_coeff: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        config = MoEConfig(
            router=RouterConfig(
                num_experts=num_experts,
                top_k=top_k,
                softmax_before_topk=False,
                logit_noise_std=logit_noise_std,
            ),
            experts=ExpertsConfig(
                hidden_size=in_size,
                ffn_hidden_size=ffn_size,
                activation="gelu",
                bias=True,
                init_std=init_std,
            ),
            losses=LossConfig(
                load_balance="switch" if aux_loss_coeff > 0 else "none",
                aux_loss_coeff=aux_loss_coeff,
                convention="hf",
                z_loss_coeff=0.0,
            ),
        )
        self.moe = MoELayer(config)
        self.moe.experts = ResidualMLPExpertBank(
            config.experts, num_experts, model_size=model_size, dropout=dropout
        )
        self.out = nn.Linear(in_size, out_size)

    def forward(self, h: Tensor) -> FieldOutput:
        """``h [B, P, D]`` → :class:`FieldOutput` (velocity ``[B, P, L]``)."""
        y = self.moe(h)
        return FieldOutput(self.out(y.hidden_states), y.aux_losses, y.record)


class DenseVelocity(nn.Module):
    """One residual-MLP block for every cell, then the ``D → L`` projection.

    Args: as :class:`MoEVelocity`'s, without routing.
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        *,
        model_size: int = 64,
        ffn_size: int = 512,
        dropout: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        experts = ExpertsConfig(
            hidden_size=in_size,
            ffn_hidden_size=ffn_size,
            activation="gelu",
            bias=True,
            init_std=init_std,
        )
        self.block = ResidualMLPExpertBank(experts, 1, model_size=model_size, dropout=dropout)
        self.out = nn.Linear(in_size, out_size)

    def forward(self, h: Tensor) -> FieldOutput:
        """``h [B, P, D]`` → :class:`FieldOutput` (velocity ``[B, P, L]``)."""
        x = h.reshape(-1, h.shape[-1])
        counts = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
        y = self.block(x, counts).reshape(h.shape)
        return FieldOutput(self.out(y))


class AttentionVelocity(nn.Module):
    """The authors' ``AttentionVelocityHead``: ``Linear(D → H) + LN``, one post-LN
    ``nn.TransformerEncoderLayer`` (``heads`` heads, feed-forward 4H, GELU) over the P cells
    of each slide, ``Linear(H → L)``."""

    def __init__(
        self,
        in_size: int,
        out_size: int,
        *,
        model_size: int = 64,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(in_size, model_size)
        self.norm = nn.LayerNorm(model_size)
        self.layer = nn.TransformerEncoderLayer(
            model_size,
            heads,
            dim_feedforward=4 * model_size,
            dropout=dropout,
            activation=F.gelu,
            batch_first=True,
        )
        self.out = nn.Linear(model_size, out_size)

    def forward(self, h: Tensor) -> FieldOutput:
        """``h [B, P, D]`` → :class:`FieldOutput` (velocity ``[B, P, L]``)."""
        return FieldOutput(self.out(self.layer(self.norm(self.inp(h)))))
