"""moelab: a PyTorch toolkit for Mixture-of-Experts models."""

__version__ = "0.1.0"
