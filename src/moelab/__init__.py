"""moelab: a PyTorch toolkit for Mixture-of-Experts models."""

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer, MoEOutput
from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord

__all__ = [
    "ExpertsConfig",
    "LossConfig",
    "MoEConfig",
    "MoELayer",
    "MoEOutput",
    "RouterConfig",
    "RoutingPlan",
    "RoutingRecord",
]
__version__ = "0.1.0"
