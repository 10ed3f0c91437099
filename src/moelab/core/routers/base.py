"""The router interface: a module that maps tokens ``[T, D]`` to a RoutingPlan."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.config import RouterConfig
from moelab.core.plan import RoutingPlan


class Router(nn.Module):
    """Linear router ``logits = x·Wᵀ`` computed in float32 whatever the input dtype (float64
    inputs keep float64, for gradient checks; Megatron's ``moe_router_dtype``).

    Subclasses turn the logits into a :class:`RoutingPlan` in :meth:`plan`. A router whose
    ``uses_batch_shape`` is True (USMoE) is called by the layer as
    ``router(x_TD, batch_shape=..., token_mask=...)``; every other router as ``router(x_TD)``.

    Attributes:
        weight: ``[E, D]`` router weight (HF ``gate.weight`` layout).
    """

    def __init__(self, config: RouterConfig, hidden_size: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=init_std)

    uses_batch_shape: bool = False

    def logits(self, x_TD: Tensor) -> Tensor:
        """Router logits ``[T, E]`` float32; input jitter U(1−eps, 1+eps) in training."""
        x = x_TD.to(torch.promote_types(x_TD.dtype, torch.float32))
        eps = self.config.jitter_eps
        if self.training and eps > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = F.linear(x, self.weight.to(x.dtype))
        if not torch.isfinite(logits).all():
            raise ValueError("router logits are not finite: the layer input contains NaN or Inf")
        return logits

    def plan(self, logits: Tensor) -> RoutingPlan:
        raise NotImplementedError

    def forward(self, x_TD: Tensor) -> RoutingPlan:
        return self.plan(self.logits(x_TD))
