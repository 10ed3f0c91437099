"""Router losses computed from RoutingPlans: load balancing (switch, sequence, global) and z-loss."""

from moelab.core.losses.balance import (
    GlobalBalanceLoss,
    SequenceBalanceLoss,
    SwitchBalanceLoss,
    build_balance_loss,
    switch_balance_loss,
)
from moelab.core.losses.zloss import router_z_loss

__all__ = [
    "GlobalBalanceLoss",
    "SequenceBalanceLoss",
    "SwitchBalanceLoss",
    "build_balance_loss",
    "router_z_loss",
    "switch_balance_loss",
]
