"""EEG-MoCE: hyperbolic mixture-of-curvature experts for multimodal EEG.

Paper: Zhou, Li, Huang, Zhou, Zhao, Kawanabe, Ding, Guan, "EEG-Based Multimodal Learning via
Hyperbolic Mixture-of-Curvature Experts", ICML 2026, arXiv 2604.12579 (METHODS.md #7); code:
zhourunhe/EEG-MoCE (non-commercial licence: read, not copied).
Each modality gets one always-active expert on its own learnable-curvature Lorentz manifold;
the experts are mixed by curvature-aware cross-attention on a fusion manifold. It is not a
routed MoE: no gate, no top-k, no balance loss; the "mixture weights" are attention weights.

Follows the authors' code as it runs (``shared/research/wave3-science.md`` §1.2) [C]: k init
0.5, learnable, clamp ≥ 1e-5, gradient clip 1.0 per manifold, no weight decay on k; the
curvature warm-up that never runs is not run; Adam with coupled weight decay 1e-3 (the
effective value); HypLinear on the full Lorentz vector; τ_m = τ₀/√|K_m| and the prior
λ·log|K_j| with **detached** curvatures (the fusion sends no gradient to k); fusion k = the
harmonic mean of the k_m, recomputed each forward; curvature projection through the origin with
the vendored geoopt's **exp-map radius clamp of 10**; weighted Lorentz midpoints; diagonal-masked
attention; early stopping on validation loss restoring the best state; float64.

This project's reading [I] (CPU scale, offline data; :mod:`moelab.data.eeg`): the research
spec's EEG-MoCE-lite: a compact conv encoder per modality, 16 steps pooled by 4, one fusion
layer with 2 heads of width 32, no Lorentz batch norm inside the stacks (the encoders'
BatchNorm is refitted on the test split instead), and a tri-modal set whose signals are real
EEG/EOG and whose pairing is synthetic. Arms: EEG-MoCE, a Euclidean twin, fixed curvature, no
curvature-aware fusion, unimodal hyperbolic and linear references.

The maths lives in the core: :mod:`moelab.core.experts.lorentz`,
:mod:`moelab.core.experts.hyperbolic`, :mod:`moelab.core.experts.curvature_attention`.
Entry points: :class:`~moelab.methods.multimodal.recipe.EEGMoCERecipe` (for
:func:`moelab.methods.runner.run_seeds`); ``moelab eeg train``; ``benchmarks/eeg_moce.py``.
"""

from moelab.methods.multimodal.config import ARMS, EEGMoCEConfig
from moelab.methods.multimodal.euclid import EuclideanCrossAttention, EuclideanTwin
from moelab.methods.multimodal.model import HyperbolicMoCE
from moelab.methods.multimodal.recipe import EEGMoCERecipe, build_model

__all__ = [
    "ARMS",
    "EEGMoCEConfig",
    "EEGMoCERecipe",
    "EuclideanCrossAttention",
    "EuclideanTwin",
    "HyperbolicMoCE",
    "build_model",
]
