"""The CoME recipe's settings: data split, model size, the arms and their training phases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.errors import require
from moelab.methods.agents.oracle import TASKS
from moelab.utils.fields import check_fields

Arm = Literal["dense", "token_moe", "come", "come_no_rft"]
Dpo = Literal["none", "info", "rule"]

ARMS: tuple[str, ...] = ("come", "come_no_rft", "token_moe", "dense")
DPO_KINDS: tuple[str, ...] = ("none", "info", "rule")
NUM_STAGES = 4


@dataclass(frozen=True)
class ComeConfig:
    """One CoME run (``shared/research/wave3-agents-alignment.md`` §3.3-3.4; [P] paper text,
    [S] secondary sources, [I] this project's choice).

    Data:
        data_path: chains ``.jsonl.gz`` (None: the shipped MiniWoB++ set).
        tasks: MiniWoB++ tasks used (empty, the default: every task in the chains).
        test_episodes: per task, the episodes with the highest seeds are held out (disjoint
            seeds [I]); train_episodes: at most this many of the rest per task (0: all).
        vocab_size: BPE vocabulary trained on the training chains; max_len: tokens per chain.

    Model [I]: d_model, n_layers, n_heads, ffn_size (the dense SwiGLU width, copied into
        ``num_experts`` experts by upcycling); num_experts must be 4 for CoME (one per stage).

    Training [I]:
        arm: ``"come"`` (Expert-FT → Router-FT → CoT-FT), ``"come_no_rft"`` (the paper's
            ablation: no Router-FT phase), ``"token_moe"`` (learned input-oriented top-1 router,
            Switch balance loss, un-normalised weights so the router learns from the LM loss)
            or ``"dense"`` (the warm-up model trained on: equal active parameters).
        warmup_steps: dense warm-up on every chain (shared by a seed's arms).
        expert_steps, router_steps, cot_steps: the three CoME phases; the token-MoE and dense
            arms train for ``expert_steps + router_steps + cot_steps`` steps, CoME without
            Router-FT for ``expert_steps + cot_steps``.
        batch_size, lr, router_lr (Router-FT), grad_clip: AdamW settings.
        router_ce_coeff: weight of the router cross-entropy in CoT-FT (0.1).
        router_norm_coeff: "Router-Norm" in CoT-FT; its form is unpublished (the paper's
            Eq. 6, [unverified]), read here as the router z-loss (1e-3) [I].
        balance_coeff: Switch balance loss of the token-MoE arm (0.01).

    Info-DPO (CoME only, ``dpo != "none"``) [S]/[I]:
        dpo: ``"info"`` (pairs ranked by the information gain of the reasoning stages) or
            ``"rule"`` (Rule-DPO: correct action chosen, wrong one rejected, no IG).
        reward_steps: stage-dropout fine-tuning of the reward LM (a copy of the warm-up).
        dpo_prompts, dpo_samples: training prompts and sampled chains per prompt (K = 4).
        dpo_temperature: sampling temperature; dpo_beta: DPO's β (0.1); dpo_steps, dpo_lr.

    Evaluation: eval_steps: held-out steps scored offline (0: all);
        online_episodes: held-out episodes per task run in the browser (0: none).

    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    data_path: str | None = None
    tasks: tuple[str, ...] = ()
    test_episodes: int = 50
    train_episodes: int = 0
    vocab_size: int = 1024
    max_len: int = 320
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_size: int = 512
    num_experts: int = NUM_STAGES
    arm: Arm = "come"
    warmup_steps: int = 300
    expert_steps: int = 100
    router_steps: int = 150
    cot_steps: int = 100
    batch_size: int = 16
    lr: float = 2e-3
    router_lr: float = 1e-2
    grad_clip: float = 1.0
    router_ce_coeff: float = 0.1
    router_norm_coeff: float = 1e-3
    balance_coeff: float = 0.01
    dpo: Dpo = "none"
    reward_steps: int = 150
    dpo_prompts: int = 256
    dpo_samples: int = 4
    dpo_temperature: float = 1.0
    dpo_beta: float = 0.1
    dpo_steps: int = 60
    dpo_lr: float = 2e-4
    eval_steps: int = 0
    online_episodes: int = 0

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.arm in ARMS, "arm", f"must be one of {', '.join(ARMS)}, got {self.arm!r}")
        require(self.dpo in DPO_KINDS, "dpo", f"must be one of {DPO_KINDS}, got {self.dpo!r}")
        require(
            self.dpo == "none" or self.arm in ("come", "come_no_rft"),
            "dpo",
            f"DPO runs on a CoME arm, got arm {self.arm!r}",
        )
        unknown = [t for t in self.tasks if t not in TASKS]
        require(not unknown, "tasks", f"must be among {TASKS}, got {unknown}")
        for name in (
            "test_episodes",
            "vocab_size",
            "max_len",
            "d_model",
            "n_layers",
            "n_heads",
            "ffn_size",
            "batch_size",
            "dpo_prompts",
            "dpo_samples",
        ):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "train_episodes",
            "warmup_steps",
            "expert_steps",
            "router_steps",
            "cot_steps",
            "reward_steps",
            "dpo_steps",
            "eval_steps",
            "online_episodes",
            "router_ce_coeff",
            "router_norm_coeff",
            "balance_coeff",
        ):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "router_lr", "grad_clip", "dpo_temperature", "dpo_beta", "dpo_lr"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(
            self.arm in ("dense", "token_moe") or self.num_experts == NUM_STAGES,
            "num_experts",
            f"CoME has one expert per stage ({NUM_STAGES}), got {self.num_experts}",
        )
        require(self.num_experts >= 2, "num_experts", f"must be >= 2, got {self.num_experts}")
        require(self.vocab_size >= 300, "vocab_size", f"must be >= 300, got {self.vocab_size}")
