"""MESA: MoE safety alignment by optimal transport (Sun et al., ICML 2026, arXiv
2606.00651), our reading — the authors' repository holds no code and the method body was not
reachable, so every detail below is labelled in ``docs/methods/mesa.md``.

Stage 1 (:mod:`.ot`, :mod:`.select`): per MoE layer, a semi-relaxed KL-regularised transport
plan from the safety routing mass to experts at a usage-percentile cost picks ``w`` experts.
Stage 2 (:mod:`.train`): response-only SFT of those experts' LoRA adapters and the routers,
plus a KL loss pulling safety tokens' routing towards them (:mod:`.routing`). Evaluation
(:mod:`.evaluate`): refusal rates clean and under the expert-masking attack
(:mod:`.attack`), refusal margin, over-refusal, utility drift, safety sparsity.
"""

from moelab.methods.alignment.attack import masked_experts
from moelab.methods.alignment.config import ARMS, AlignConfig
from moelab.methods.alignment.data import Prompts, load_prompts
from moelab.methods.alignment.evaluate import evaluate_alignment
from moelab.methods.alignment.ot import (
    co_selection_prior,
    expert_scores,
    select_top,
    transport_cost,
    transport_plan,
    usage_percentiles,
)
from moelab.methods.alignment.recipe import Aligned, MESARecipe
from moelab.methods.alignment.refusal import is_refusal

__all__ = [
    "ARMS",
    "AlignConfig",
    "Aligned",
    "MESARecipe",
    "Prompts",
    "co_selection_prior",
    "evaluate_alignment",
    "expert_scores",
    "is_refusal",
    "load_prompts",
    "masked_experts",
    "select_top",
    "transport_cost",
    "transport_plan",
    "usage_percentiles",
]
