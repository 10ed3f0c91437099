"""MoELayer: router → RoutingPlan → dispatcher → experts → combine, with losses and telemetry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelab.core.config import MoEConfig
from moelab.core.dispatch import LocalDispatcher
from moelab.core.experts import ExpertBank, SharedExpert
from moelab.core.losses import SpecializationLoss, build_balance_loss, router_z_loss
from moelab.core.plan import RoutingPlan
from moelab.core.routers import build_router
from moelab.core.routers.usmoe import PrefixState
from moelab.core.telemetry import RoutingRecord


@dataclass
class MoEOutput:
    """What one MoE layer call returns.

    Attributes:
        hidden_states: same shape and dtype as the input.
        aux_losses: float32 scalars with their coefficients applied: ``"load_balance"``,
            ``"z_loss"`` and ``"specialization"`` when enabled. Add their sum to the training
            loss. Empty under ``torch.no_grad()`` (nothing to train; inference skips the work).
        record: detached routing telemetry.
        plan: the routing plan (keeps the graph; losses defined outside the layer use it).
    """

    hidden_states: Tensor
    aux_losses: dict[str, Tensor]
    record: RoutingRecord
    plan: RoutingPlan


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer.

    ``y = Σ_{(t,e,w) ∈ plan} w · expert_e(x_t) [+ shared_expert(x_t)]``

    Args:
        config: router, experts and loss settings.
        dispatcher: token dispatcher (default: :class:`LocalDispatcher`).

    Forward:
        x: ``[..., D]`` any float dtype; the router runs in float32, the experts in x's dtype,
            the weighted combine in float32.
        mask: ``[...]`` bool, True for real tokens; padded tokens are still computed but
            excluded from losses and telemetry. None = all real.
    Raises:
        ValueError: x's last dimension is not D, the mask's shape or dtype is wrong, or the
            input contains NaN/Inf.
    """

    def __init__(self, config: MoEConfig, dispatcher: LocalDispatcher | None = None) -> None:
        super().__init__()
        self.config = config
        ex = config.experts
        self.router = build_router(config.router, ex.hidden_size, ex.init_std)
        self.experts = ExpertBank(ex, config.router.num_experts)
        self.shared_expert = (
            SharedExpert(ex.hidden_size, ex.shared_expert_size, ex.shared_expert_gate, ex.init_std)
            if ex.shared_expert_size
            else None
        )
        self.dispatcher = dispatcher or LocalDispatcher()
        self.balance_loss = build_balance_loss(config.losses)
        self.specialization_loss = (
            SpecializationLoss(config.losses.specialization_penalty)
            if config.losses.specialization
            else None
        )

    def reset_loss_state(self) -> None:
        """Clear per-step accumulators (global-batch loss); call after each optimizer step."""
        if hasattr(self.balance_loss, "reset"):
            self.balance_loss.reset()

    def _check(self, x: Tensor, mask: Tensor | None) -> None:
        D = self.config.experts.hidden_size
        if x.dim() < 1 or x.shape[-1] != D:
            raise ValueError(f"x: expected shape [..., {D}], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
        if mask is not None:
            if mask.dtype != torch.bool:
                raise TypeError(f"mask: expected torch.bool, got {mask.dtype}")
            if mask.shape != x.shape[:-1]:
                raise ValueError(
                    f"mask: expected shape {tuple(x.shape[:-1])}, got {tuple(mask.shape)}"
                )

    @property
    def needs_prefix_state(self) -> bool:
        """True when incremental decoding must carry router state (causal-prefix USMoE)."""
        cfg = self.config.router
        return cfg.kind == "usmoe" and cfg.selection_scope == "causal_prefix"

    def forward(
        self, x: Tensor, mask: Tensor | None = None, prefix_state: PrefixState | None = None
    ) -> MoEOutput:
        """``x [..., D]`` → :class:`MoEOutput`. ``mask [...]`` bool marks real tokens;
        ``prefix_state`` carries causal-prefix USMoE routing across decoding calls."""
        self._check(x, mask)
        batch_shape = tuple(x.shape[:-1])
        x_TD = x.reshape(-1, x.shape[-1])
        T = x_TD.shape[0]
        token_mask = (
            mask.reshape(-1)
            if mask is not None
            else torch.ones(T, dtype=torch.bool, device=x.device)
        )
        if self.router.uses_batch_shape:
            kw = {"prefix_state": prefix_state} if prefix_state is not None else {}
            plan = self.router(x_TD, batch_shape=batch_shape, token_mask=token_mask, **kw)
        else:
            plan = self.router(x_TD)
        dispatched = self.dispatcher.dispatch(x_TD, plan)
        want_losses = torch.is_grad_enabled()
        acts = None
        if want_losses and self.specialization_loss is not None:
            expert_out, acts = self.experts(
                dispatched.x, dispatched.counts, return_activations=True
            )
        else:
            expert_out = self.experts(dispatched.x, dispatched.counts)
        y = self.dispatcher.combine(expert_out, dispatched, T)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_TD).to(y.dtype)
        losses = self.config.losses
        aux: dict[str, Tensor] = {}
        if want_losses and self.balance_loss is not None and losses.aux_loss_coeff > 0:
            aux["load_balance"] = losses.aux_loss_coeff * self.balance_loss(
                plan, token_mask, batch_shape
            )
        if want_losses and losses.z_loss_coeff > 0:
            aux["z_loss"] = losses.z_loss_coeff * router_z_loss(plan.logits, token_mask)
        if acts is not None:
            aux["specialization"] = losses.specialization_coeff * self.specialization_loss(
                acts, dispatched.token_idx, token_mask
            )
        return MoEOutput(
            hidden_states=y.to(x.dtype).reshape(x.shape),
            aux_losses=aux,
            record=RoutingRecord.from_plan(plan, token_mask, batch_shape, padded=mask is not None),
            plan=plan,
        )
