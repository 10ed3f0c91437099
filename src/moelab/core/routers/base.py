"""The router interface: a module that maps tokens ``[T, D]`` to a RoutingPlan."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core import checks
from moelab.core.autocast import autocast_off
from moelab.core.config import RouterConfig
from moelab.core.plan import RoutingPlan


class Router(nn.Module):
    """Linear router ``logits = x·Wᵀ`` computed in float32 whatever the input dtype and the
    autocast state (float64 inputs keep float64, for gradient checks; Megatron's
    ``moe_router_dtype``).

    Subclasses turn the logits into a :class:`RoutingPlan` in :meth:`plan`. A router whose
    ``uses_batch_shape`` is True (USMoE) is called by the layer as
    ``router(x_TD, batch_shape=..., token_mask=...)``; one whose ``masks_padding`` is True as
    ``router(x_TD, token_mask=...)`` when the input has padding (so padding takes no expert
    slot); every other router as ``router(x_TD)``.

    Router state (buffers named in ``fp32_buffers``, e.g. the expert bias) stays float32
    under ``module.to(dtype)`` / ``.half()`` / ``.bfloat16()``: only its device follows, so
    bias updates of 1e-3 on a bias of 0.5 are not rounded away in bf16.

    Attributes:
        weight: ``[E, D_r]`` router weight (HF ``gate.weight`` layout); ``D_r`` is
            ``config.input_size`` for a context router, else the experts' hidden size.
    """

    uses_batch_shape: bool = False
    masks_padding: bool = False
    fp32_buffers: tuple[str, ...] = ("expert_bias",)

    def __init__(self, config: RouterConfig, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=init_std)

    def _apply(self, fn, recurse: bool = True):
        kept = {
            name: buf
            for name, buf in self._buffers.items()
            if name in self.fp32_buffers and buf is not None and buf.dtype == torch.float32
        }
        out = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != torch.float32:
                self._buffers[name] = before.to(device=after.device)
        return out

    def logits(self, x_TD: Tensor) -> Tensor:
        """Router logits ``[T, E]`` float32 of ``x_TD [T, D_r]``; input jitter U(1−eps, 1+eps)
        in training (done by the layer instead when ``jitter_experts``, so experts see the same
        jitter) and, with ``logit_noise_std`` σ, additive ``N(0, σ²)`` logit noise in training.

        Raises:
            ValueError: non-finite logits, only when :mod:`moelab.core.checks` are enabled
                (the check syncs with the device).
        """
        x = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
        eps = self.config.jitter_eps
        if self.training and eps > 0 and not self.config.jitter_experts:
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        with autocast_off(x.device):  # float32 logits under mixed precision too
            logits = F.linear(x, self.weight.to(x.dtype))
        if self.training and self.config.logit_noise_std > 0:
            logits = logits + torch.randn_like(logits) * self.config.logit_noise_std
        if checks.value_checks() and not torch.isfinite(logits).all():
            raise ValueError("router logits are not finite: the layer input contains NaN or Inf")
        return logits

    def plan(self, logits: Tensor) -> RoutingPlan:
        raise NotImplementedError

    def forward(self, x_TD: Tensor, token_mask: Tensor | None = None) -> RoutingPlan:
        if token_mask is None:
            return self.plan(self.logits(x_TD))
        return self.plan(self.logits(x_TD), token_mask=token_mask)
