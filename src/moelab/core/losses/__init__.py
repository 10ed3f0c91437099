"""Router losses computed from RoutingPlans: load balancing (switch, sequence, global), z-loss,
the specialization loss and the cross-layer dependency loss (arXiv 2602.14159)."""

from moelab.core.losses.balance import (
    GlobalBalanceLoss,
    SequenceBalanceLoss,
    SwitchBalanceLoss,
    build_balance_loss,
    switch_balance_loss,
)
from moelab.core.losses.cross_layer import (
    CrossLayerLoss,
    joint_topk_loss,
    pathway_loss,
    token_joint_loss,
)
from moelab.core.losses.normalise import global_token_normalised
from moelab.core.losses.specialization import (
    SpecializationLoss,
    coactivated_pairs,
    specialization_loss,
)
from moelab.core.losses.zloss import router_z_loss

__all__ = [
    "CrossLayerLoss",
    "GlobalBalanceLoss",
    "SequenceBalanceLoss",
    "SpecializationLoss",
    "SwitchBalanceLoss",
    "build_balance_loss",
    "coactivated_pairs",
    "global_token_normalised",
    "joint_topk_loss",
    "pathway_loss",
    "router_z_loss",
    "specialization_loss",
    "switch_balance_loss",
    "token_joint_loss",
]
