"""MoLF: conditional flow matching in a gene latent space with a Mixture-of-Experts velocity field.

Paper: Hu & Speidel, "MoLF: Mixture-of-Latent-Flow for Pan-Cancer Spatial Gene Expression
Prediction from Histology", ICML 2026, arXiv 2602.02282 (METHODS.md #9); code: susuhu/MoLF
(CC BY-NC 4.0: read, not copied).
A VAE gives a gene latent manifold (stage 1, frozen); conditional flow matching maps noise to
it (stage 2) with a velocity field that is an MoE, so different tissues' morphology→expression
maps can be served by different experts.

Follows the authors' code as it runs (``shared/research/wave3-science.md`` §3.2):

* the CondOT path and velocity target, per-slide times and std-scaled noise, a small noise on
  ``x_t``, flow MSE + balance loss + one-step gene reconstruction (:mod:`.path`, :mod:`.model`);
* CFG dropout of a slide's whole view to a learned embedding, the tissue code kept; Euler
  sampling from ``N(0, I)`` with ``v_u + w(v_c − v_u)``, counting evaluations (:mod:`.sampler`);
* the gate (linear, N(0, 0.01²) logit noise in training, top-2 of 6 on the logits, softmax
  over the two), the Switch balance loss in transformers' convention from the noisy logits,
  weight 1.0, no z-loss; residual-MLP experts (one post-LN Transformer block on one token)
  (:mod:`.velocity`, :class:`moelab.core.experts.residual.ResidualMLPExpertBank`);
* the VAE's LayerNormed mean, its decoder shape, KL weight 1e-7, 15 % input masking, training
  latent noise 0.1 (:mod:`.vae`); AdamW with a separate router learning rate, linear warm-up
  and decay, clipping at 1.0 (:mod:`.loop`);
* the arms: the SimpleMLP regression baseline, the attention-across-cells head (the authors'
  own non-MoE ablation), plus this project's dense twin with matched active parameters and
  the MoE without its balance loss.

This project's reading (CPU-sized, offline data; :mod:`moelab.data.singlecell`): real PBMC
expression instead of spatial transcriptomics, a paired real view of the same cells instead of
histology embeddings, pseudo-slides, a synthetic "conflict" variant; an MLP VAE encoder over
one cell, the tissue code concatenated instead of cross-attended, no spatial Transformer over
patch order, folded ``W_v·W_o`` in the experts, no router bias, fixed step counts instead of
early stopping on validation loss; widths scaled down (latent 8, experts 64/512).
The authors' ``flow_matching`` dependency (CC BY-NC) is not used: the maths is written here.

Entry points: :class:`~moelab.methods.flow.recipe.MoLFRecipe` (for
:func:`moelab.methods.runner.run_seeds`), :func:`~moelab.methods.flow.expression.train_expression`
and :func:`~moelab.methods.flow.expression.predict`; ``moelab flow train|sample``;
``benchmarks/molf.py``.
"""

from moelab.methods.flow.config import FlowConfig
from moelab.methods.flow.expression import (
    ExpressionRun,
    evaluate_expression,
    predict,
    train_expression,
)
from moelab.methods.flow.model import LatentFlow
from moelab.methods.flow.recipe import MoLFRecipe
from moelab.methods.flow.sampler import Sample, cfg_velocity, euler_sample, odeint_sample
from moelab.methods.flow.velocity import AttentionVelocity, DenseVelocity, MoEVelocity

__all__ = [
    "AttentionVelocity",
    "DenseVelocity",
    "ExpressionRun",
    "FlowConfig",
    "LatentFlow",
    "MoEVelocity",
    "MoLFRecipe",
    "Sample",
    "cfg_velocity",
    "euler_sample",
    "evaluate_expression",
    "odeint_sample",
    "predict",
    "train_expression",
]
