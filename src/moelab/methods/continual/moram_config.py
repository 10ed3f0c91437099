"""MoRAM's settings, shared by its label-prompt baselines (a module of its own: the run
config holds them, and the learners import the config).

Labels as in ``wave3-continual.md`` §2: [C] the authors' code (Artificer-AI-Lab/MoRAM,
``XTAIL/runner_moram.sh``, ``XTAIL/models/moram.py``), [I] this project's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelab.errors import require
from moelab.utils.fields import check_fields


@dataclass(frozen=True)
class MoRAMSettings:
    """MoRAM's knobs and the training schedule of every label-prompt learner (MoRAM and its
    baselines share it, so they get the same budget).

    Attributes:
        rank: r, atoms per layer per domain (and the LoRA baselines' rank): 8 [I: the
            authors' 16 at D = 768, halved with MiniLM's D = 384].
        topk: atoms kept per token before the softmax; 0 means r (the authors' default [C]).
        temperature: τ = 0.01 [C].
        threshold: δ = 0.2, the evaluation gate [C].
        scale: s = 100, the classifier's logit scale (CLIP's ``logit_scale`` [I]).
        lr: AdamW learning rate, 5e-4 [C] (betas (0.9, 0.9999) [C]).
        weight_decay: 0 [C].
        iterations: steps per domain, 80 at batch size ``ContinualConfig.batch_size`` 16 [I:
            the authors run 500 at batch 64].
        moe_top_k: experts per token of the MoE-LoRA baseline, 2 [I].
        targets: adapted layers of each block, by module name: q, k, v, attention output,
            FFN in and out (the authors' ``qkvoinout`` [C]).
    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    rank: int = 8
    topk: int = 0
    temperature: float = 0.01
    threshold: float = 0.2
    scale: float = 100.0
    lr: float = 5e-4
    weight_decay: float = 0.0
    iterations: int = 80
    moe_top_k: int = 2
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "up", "down")

    def __post_init__(self) -> None:
        check_fields(self, prefix="moram.")
        for name in ("rank", "iterations", "moe_top_k"):
            v = getattr(self, name)
            require(v >= 1, f"moram.{name}", f"must be >= 1, got {v}")
        require(self.topk >= 0, "moram.topk", f"must be >= 0 (0: rank), got {self.topk}")
        for name in ("temperature", "scale", "lr"):
            v = getattr(self, name)
            require(v > 0, f"moram.{name}", f"must be > 0, got {v}")
        require(
            0 <= self.threshold <= 1,
            "moram.threshold",
            f"must be in [0, 1], got {self.threshold}",
        )
        require(
            self.weight_decay >= 0,
            "moram.weight_decay",
            f"must be >= 0, got {self.weight_decay}",
        )
        require(bool(self.targets), "moram.targets", "must name at least one layer")
