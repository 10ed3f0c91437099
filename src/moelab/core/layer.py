"""MoELayer: router → RoutingPlan → dispatcher → experts → combine, with losses and telemetry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelab.core.config import MoEConfig
from moelab.core.dispatch import Dispatched, LocalDispatcher
from moelab.core.experts import ExpertBank, SharedExpert
from moelab.core.losses import (
    SpecializationLoss,
    build_balance_loss,
    global_token_normalised,
    router_z_loss,
)
from moelab.core.plan import RoutingPlan, check_expert_ids
from moelab.core.routers import TopKRouter, build_router
from moelab.core.routers.usmoe import PrefixState
from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidTypeError, InvalidValueError


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
        loss_div_factor: the number of real tokens of the whole batch (over micro-batches,
            and ranks if the gradients are summed; OLMo-core's ``loss_div_factor``). Given,
            every aux loss, a mean over this call's n real tokens, is rescaled to
            ``n · loss / loss_div_factor`` (:func:`moelab.core.losses.global_token_normalised`),
            so summing the micro-batches' losses weighs every real token of the batch
            equally, whatever the padding and micro-batch sizes.
        segment_ids: ``[T]`` int64 in ``[0, T)``, the sequence (packed document) of every
            token for the sequence-level balance loss (:mod:`moelab.models.packing`).
    Raises:
        ValueError: x's last dimension is not D, the mask's shape or dtype is wrong, or (only
            with :mod:`moelab.core.checks` enabled: the check syncs) the input contains
            NaN/Inf.
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

    def end_micro_batch(self) -> None:
        """Commit the last forward's routing counts to the step's accumulators (global-batch
        loss); call once after each micro-batch's backward. Forward itself accumulates
        nothing, so recomputation (activation checkpointing) cannot count tokens twice."""
        if hasattr(self.balance_loss, "commit"):
            self.balance_loss.commit()

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

    def _experts(
        self, x_TD: Tensor, plan: RoutingPlan, want_acts: bool
    ) -> tuple[Tensor, Dispatched, Tensor | None]:
        """Dispatch, experts and combine: ``(y [T, D] float32, dispatched, activations or
        None)``."""
        T = x_TD.shape[0]
        if not want_acts and self._fuses_dispatch(x_TD, plan):
            d = self.dispatcher.dispatch(x_TD, plan, gather=False)
            return self.experts.forward_tokens(x_TD, d), d, None
        d = self.dispatcher.dispatch(x_TD, plan)
        if want_acts:
            expert_out, acts = self.experts(d.x, d.counts, return_activations=True)
            return self.dispatcher.combine(expert_out, d, T), d, acts
        if hasattr(self.experts, "forward_combined"):  # quantized bank: fused low-rank path
            return self.experts.forward_combined(d, T, self.dispatcher.combine, x_TD), d, None
        return self.dispatcher.combine(self.experts(d.x, d.counts), d, T), d, None

    def _fuses_dispatch(self, x_TD: Tensor, plan: RoutingPlan) -> bool:
        """The fused CPU kernel gathers, computes and un-permutes in one pass (uniform plans,
        local dispatch, plain in-memory experts)."""
        return (
            plan.top_k is not None
            and isinstance(self.dispatcher, LocalDispatcher)
            and isinstance(self.experts, ExpertBank)
            and self.experts.fuses(x_TD)
        )

    def _router_tokens(
        self, x_TD: Tensor, batch_shape: tuple[int, ...], router_input: Tensor | None
    ) -> Tensor:
        """What the router scores: ``x_TD`` or the flattened ``router_input`` ``[T, D_r]``."""
        d_r = self.router.weight.shape[1]
        if router_input is None:
            if d_r != x_TD.shape[1]:
                raise InvalidValueError(
                    f"router_input: this layer's router scores inputs of width {d_r} "
                    f"(RouterConfig.input_size), not the tokens (width {x_TD.shape[1]}); pass "
                    "router_input"
                )
            return x_TD
        if not isinstance(router_input, Tensor) or not router_input.is_floating_point():
            got = router_input.dtype if isinstance(router_input, Tensor) else type(router_input)
            raise InvalidTypeError(f"router_input: expected a floating-point tensor, got {got}")
        if tuple(router_input.shape) != (*batch_shape, d_r):
            raise InvalidValueError(
                f"router_input: expected shape {(*batch_shape, d_r)} (x's leading shape, then "
                f"the router's input width {d_r}), got {tuple(router_input.shape)}"
            )
        return router_input.reshape(-1, d_r)

    def _route(
        self,
        r_TD: Tensor,
        batch_shape: tuple[int, ...],
        token_mask: Tensor,
        mask: Tensor | None,
        prefix_state: PrefixState | None,
        expert_ids: Tensor | None,
    ) -> RoutingPlan:
        """Call the router the way its kind expects (see :class:`Router`)."""
        if expert_ids is not None:
            return self._forced_plan(r_TD, batch_shape, token_mask, mask, expert_ids)
        if self.router.uses_batch_shape:
            kw = {"prefix_state": prefix_state} if prefix_state is not None else {}
            return self.router(r_TD, batch_shape=batch_shape, token_mask=token_mask, **kw)
        if self.router.masks_padding and mask is not None:
            return self.router(r_TD, token_mask=token_mask)
        return self.router(r_TD)

    def _forced_plan(
        self,
        r_TD: Tensor,
        batch_shape: tuple[int, ...],
        token_mask: Tensor,
        mask: Tensor | None,
        expert_ids: Tensor,
    ) -> RoutingPlan:
        rc = self.config.router
        if not isinstance(self.router, TopKRouter):
            raise InvalidValueError(
                f"expert_ids: forced routing needs a token-choice router, this layer's is "
                f"{rc.kind!r}; pass a whole plan instead"
            )
        shape = (*batch_shape, rc.top_k)
        if not isinstance(expert_ids, Tensor) or tuple(expert_ids.shape) != shape:
            got = tuple(expert_ids.shape) if isinstance(expert_ids, Tensor) else expert_ids
            raise InvalidValueError(
                f"expert_ids: expected shape {shape} (x's leading shape, then top_k), got {got}"
            )
        ids = check_expert_ids(expert_ids, rc.num_experts, "expert_ids")
        forced = ids.reshape(-1, rc.top_k).to(r_TD.device)
        return self.router.plan(
            self.router.logits(r_TD), token_mask if mask is not None else None, forced=forced
        )

    def _check_plan(self, plan: RoutingPlan, num_tokens: int) -> None:
        """A plan from outside routes this call's T tokens to this layer's E experts."""
        E = self.config.router.num_experts
        if not isinstance(plan, RoutingPlan):
            raise InvalidTypeError(f"plan: expected a RoutingPlan, got {type(plan).__name__}")
        if plan.num_experts != E or plan.num_tokens != num_tokens:
            raise InvalidValueError(
                f"plan: routes {plan.num_tokens} tokens to {plan.num_experts} experts, this call "
                f"has {num_tokens} tokens and the layer {E} experts"
            )
        check_expert_ids(plan.expert_idx, E, "plan.expert_idx")
        if plan.num_pairs and (
            int(plan.token_idx.min()) < 0 or int(plan.token_idx.max()) >= num_tokens
        ):
            raise InvalidValueError(f"plan.token_idx: entries must lie in [0, {num_tokens})")
        if not bool(torch.isfinite(plan.weight).all()):
            raise InvalidValueError("plan.weight: combine weights must be finite")

    @property
    def needs_prefix_state(self) -> bool:
        """True when incremental decoding must carry router state (causal-prefix USMoE)."""
        cfg = self.config.router
        return cfg.kind == "usmoe" and cfg.selection_scope == "causal_prefix"

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        prefix_state: PrefixState | None = None,
        loss_div_factor: float | Tensor | None = None,
        segment_ids: Tensor | None = None,
        *,
        router_input: Tensor | None = None,
        expert_ids: Tensor | None = None,
        plan: RoutingPlan | None = None,
    ) -> MoEOutput:
        """``x [..., D]`` → :class:`MoEOutput`. ``mask [...]`` bool marks real tokens;
        ``prefix_state`` carries causal-prefix USMoE routing across decoding calls;
        ``loss_div_factor`` and ``segment_ids`` as in the class docstring.

        Routing seams (keyword-only; at most one of ``expert_ids`` and ``plan``):

        - ``router_input [..., D_r]``: what the router scores instead of ``x`` (a context
          router: ``RouterConfig.input_size = D_r``; text features steering time-series
          experts, a phase or task state). Its leading shape must equal ``x``'s; broadcast a
          per-sample context over positions with ``ctx[:, None].expand(B, S, D_r)``. The
          experts still compute on ``x``. Required when ``input_size`` differs from D.
        - ``expert_ids [..., k]`` integer: forced routing (token-choice routers only): token
          t goes to exactly these k experts (k = ``top_k``); the combine weights come from the
          router's scores at those experts with its weight rule, so the router keeps its
          gradient (stage experts, one-expert-per-phase policies). Generalises router replay
          (:mod:`moelab.core.replay`) to ids from anywhere; capacity, if set, still applies.
        - ``plan``: a whole :class:`RoutingPlan` built outside (``T`` = the number of
          tokens of ``x``, ``E`` = this layer's experts); the router is not called, and the
          losses read the plan's logits and probs.

        Raises:
            ValueError: a routing seam with the wrong shape, an expert id outside
                ``[0, E)``, ``expert_ids`` on a router that is not token choice, or both
                ``expert_ids`` and ``plan``.
        """
        self._check(x, mask)
        batch_shape = tuple(x.shape[:-1])
        x_TD = x.reshape(-1, x.shape[-1])
        T = x_TD.shape[0]
        token_mask = (
            mask.reshape(-1)
            if mask is not None
            else torch.ones(T, dtype=torch.bool, device=x.device)
        )
        rc = self.config.router
        if self.training and rc.jitter_experts and rc.jitter_eps > 0:
            # transformers' Mixtral: the jittered hidden states feed the router and the experts
            noise = torch.empty_like(x_TD).uniform_(1.0 - rc.jitter_eps, 1.0 + rc.jitter_eps)
            x_TD = x_TD * noise
        if plan is not None:
            if expert_ids is not None:
                raise InvalidValueError("expert_ids, plan: give at most one of them")
            self._check_plan(plan, T)
        else:
            r_TD = self._router_tokens(x_TD, batch_shape, router_input)
            plan = self._route(r_TD, batch_shape, token_mask, mask, prefix_state, expert_ids)
        want_losses = torch.is_grad_enabled()
        want_acts = want_losses and self.specialization_loss is not None
        y, dispatched, acts = self._experts(x_TD, plan, want_acts)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_TD).to(y.dtype)
        losses = self.config.losses
        aux: dict[str, Tensor] = {}
        if want_losses and self.balance_loss is not None and losses.aux_loss_coeff > 0:
            extra = {} if segment_ids is None else {"segment_ids": segment_ids}
            aux["load_balance"] = losses.aux_loss_coeff * self.balance_loss(
                plan, token_mask, batch_shape, **extra
            )
        if want_losses and losses.z_loss_coeff > 0:
            aux["z_loss"] = losses.z_loss_coeff * router_z_loss(plan.logits, token_mask)
        if acts is not None:
            aux["specialization"] = losses.specialization_coeff * self.specialization_loss(
                acts, dispatched.token_idx, token_mask
            )
        if loss_div_factor is not None and aux:
            aux = global_token_normalised(aux, token_mask, loss_div_factor)
        return MoEOutput(
            hidden_states=y.to(x.dtype).reshape(x.shape),
            aux_losses=aux,
            record=RoutingRecord.from_plan(plan, token_mask, batch_shape, padded=mask is not None),
            plan=plan,
        )
