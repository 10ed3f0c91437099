"""Routers: token choice, expert choice, USMoE, Sinkhorn, and the aux-loss-free bias update."""

from moelab.core.config import RouterConfig
from moelab.core.routers.base import Router
from moelab.core.routers.bias import update_expert_bias
from moelab.core.routers.expert_choice import ExpertChoiceRouter
from moelab.core.routers.sinkhorn import SinkhornRouter, sinkhorn
from moelab.core.routers.token_choice import TopKRouter
from moelab.core.routers.usmoe import USMoERouter, solve_budgeted_assignment, unified_scores

_ROUTERS: dict[str, type[Router]] = {
    "token_choice": TopKRouter,
    "expert_choice": ExpertChoiceRouter,
    "usmoe": USMoERouter,
    "sinkhorn": SinkhornRouter,
}


def build_router(config: RouterConfig, hidden_size: int, init_std: float = 0.02) -> Router:
    """The router class named by ``config.kind``, routing inputs of width
    ``config.input_size`` (a context router) or, when that is None, ``hidden_size``."""
    return _ROUTERS[config.kind](config, config.input_size or hidden_size, init_std)


__all__ = [
    "ExpertChoiceRouter",
    "Router",
    "SinkhornRouter",
    "TopKRouter",
    "USMoERouter",
    "build_router",
    "sinkhorn",
    "solve_budgeted_assignment",
    "unified_scores",
    "update_expert_bias",
]
