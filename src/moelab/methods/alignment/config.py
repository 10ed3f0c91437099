"""The MESA recipe's settings: one dataclass for the model, the data sizes, the selection,
the training and the evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.errors import require
from moelab.utils.fields import check_fields

Arm = Literal["mesa", "all", "ot_only", "max_cost"]
ARMS: tuple[str, ...] = ("mesa", "all", "ot_only", "max_cost")
"""``mesa``: OT-selected experts' LoRA + routers + the OT routing loss; ``all``: all-expert
SFT, LoRA on every expert + routers (the paper's baseline); ``ot_only``: OT-selected LoRA,
routers frozen, no routing loss; ``max_cost``: the w most expensive experts + routers + the
routing loss (ablation)."""


@dataclass(frozen=True)
class AlignConfig:
    """One MESA alignment run (defaults: the reproduction spec of
    ``wave3-agents-alignment.md`` §2.4; the paper's values are unknown, so every default is
    [I] unless marked).

    Model:
        source: a pretrained name (``"smollm2"``) or a moelab model folder; a dense model is
            upcycled here into ``num_experts``, ``top_k`` MoE layers from block
            ``first_moe_layer`` up (router rows random, seeded by the run seed, selection
            bias on); an MoE folder is used as it is (``first_moe_layer`` then is its first
            MoE block).
        lora_rank, lora_alpha: expert adapters (8, 16).
        max_seq_len: positions kept (prompts are short).

    Data (sizes; the prompts are fixed across seeds, in file order):
        n_safe: Do-Not-Answer prompts answered with refusals (safety stream).
        n_gen_prompts: benign-edgy prompts answered with the base model's own greedy
            responses of ``gen_tokens`` tokens; n_gen_windows: corpus windows of
            ``window_tokens`` tokens (general stream).
        n_stat: Do-Not-Answer prompts (disjoint) and as many windows for the statistics.
        n_eval_harmful, n_eval_past: HarmBench and past-tense prompts for refusal rates;
        n_eval_margin: HarmBench prompts for the teacher-forced margin; n_eval_benign:
        benign-edgy prompts (disjoint from training) for over-refusal and drift;
        n_eval_windows: held-out corpus windows for Δ bits per byte.
        eval_tokens: greedy tokens generated per prompt for refusal matching.

    Selection:
        arm: see :data:`ARMS`. w: experts selected per layer (4 of 8).
        epsilon: OT / routing-target temperature ε (0.05); cost_alpha: α of the cost (1);
        rho: target-marginal KL penalty (0 = semi-relaxed, closed form).

    Training:
        gamma: weight of the routing loss (0.1); lora_lr, router_lr: AdamW (1e-3, 1e-4);
        epochs, batch_size: 1, 8.

    Attack: attack_m experts masked per layer (2).
    """

    source: str = "smollm2"
    num_experts: int = 8
    top_k: int = 2
    first_moe_layer: int = 22
    lora_rank: int = 8
    lora_alpha: float = 16.0
    max_seq_len: int = 256
    n_safe: int = 256
    n_gen_prompts: int = 64
    n_gen_windows: int = 192
    gen_tokens: int = 48
    window_tokens: int = 64
    n_stat: int = 128
    n_eval_harmful: int = 64
    n_eval_past: int = 64
    n_eval_margin: int = 200
    n_eval_benign: int = 86
    n_eval_windows: int = 32
    eval_tokens: int = 16
    arm: Arm = "mesa"
    w: int = 4
    epsilon: float = 0.05
    cost_alpha: float = 1.0
    rho: float = 0.0
    gamma: float = 0.1
    lora_lr: float = 1e-3
    router_lr: float = 1e-4
    epochs: int = 1
    batch_size: int = 8
    attack_m: int = 2

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (
            "num_experts", "top_k", "lora_rank", "n_safe", "n_stat", "gen_tokens",
            "window_tokens", "n_eval_harmful", "n_eval_margin", "n_eval_benign",
            "n_eval_windows", "eval_tokens", "epochs", "batch_size", "w",
        ):  # fmt: skip
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "n_gen_prompts",
            "n_gen_windows",
            "n_eval_past",
            "first_moe_layer",
            "attack_m",
        ):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(
            self.top_k <= self.num_experts, "top_k", f"must be <= num_experts, got {self.top_k}"
        )
        require(
            self.w <= self.num_experts,
            "w",
            f"must be <= num_experts={self.num_experts}, got {self.w}",
        )
        require(
            self.attack_m <= self.num_experts - self.top_k,
            "attack_m",
            f"must leave top_k experts unmasked (<= {self.num_experts - self.top_k}), got {self.attack_m}",
        )
        for name in ("lora_alpha", "epsilon", "cost_alpha", "lora_lr", "router_lr"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("rho", "gamma"):
            require(
                0 <= getattr(self, name) < float("inf"),
                name,
                f"must be finite and >= 0, got {getattr(self, name)}",
            )
        require(self.max_seq_len >= 64, "max_seq_len", f"must be >= 64, got {self.max_seq_len}")
        require(
            self.n_gen_prompts + self.n_eval_benign <= 150,
            "n_eval_benign",
            "n_gen_prompts + n_eval_benign must be <= 150 (the probe set)",
        )
        require(
            self.n_safe + self.n_stat <= 822,
            "n_stat",
            "n_safe + n_stat must be <= 822 (Do-Not-Answer)",
        )
