"""Typed configs of the MoE layer (names follow Megatron-Core / Hugging Face where they exist)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from moelab.errors import InvalidValueError, require
from moelab.utils.fields import check_fields

ScoreFunc = Literal["softmax", "sigmoid", "sqrtsoftplus"]
RouterKind = Literal["token_choice", "expert_choice", "usmoe", "sinkhorn"]
GroupScore = Literal["top2", "topk_per_group"]
USMoEScore = Literal["sigmoid_scaled", "softmax_over_tokens", "paper_expert_choice"]
SelectionScope = Literal["position", "sequence", "batch", "causal_prefix"]
CAUSAL_SCOPES = ("position", "causal_prefix")
USMoEWeightNorm = Literal["auto", "none", "all_experts", "selected"]
USMoEConstraint = Literal["global", "per_token", "per_expert"]
SpecPenalty = Literal["square", "cos", "relu"]
CrossLayerVariant = Literal["joint_topk", "pathway", "token"]
DropPolicy = Literal["probs", "position"]
Activation = Literal["swiglu", "gelu", "gelu_tanh", "geglu", "swiglu_clamped"]
GATED_ACTIVATIONS = ("swiglu", "geglu", "swiglu_clamped")
BalanceLoss = Literal["switch", "seq", "global", "none"]
BalanceConvention = Literal["megatron", "hf"]


@dataclass
class RouterConfig:
    """How tokens are assigned to experts.

    Attributes:
        num_experts: E, routed experts (>= 1).
        top_k: k, experts per token for token choice (1 <= k <= E); for expert choice the
            average pairs per token, which sets capacity = ceil(T·k/E · capacity_factor).
        kind: ``"token_choice"`` (each token picks k experts), ``"expert_choice"`` (each
            expert picks its top-capacity tokens; Zhou et al. 2022, arXiv 2202.09368),
            ``"usmoe"`` or ``"sinkhorn"`` (token choice on Sinkhorn-balanced scores in
            training; Megatron-Core's ``sinkhorn`` load balancing; :mod:`~moelab.core.routers.sinkhorn`).
        score_func: ``"softmax"``, ``"sigmoid"`` (DeepSeek-V3) or ``"sqrtsoftplus"``
            (``sqrt(softplus(ℓ))``, DeepSeek-V4; elementwise like sigmoid). Elementwise scores
            are normalised in log space, so normalisation is exact for any finite logits.
        softmax_before_topk: softmax over all E then top-k (Mixtral/Qwen/OLMoE) when True;
            top-k on logits then softmax over the k selected logits when False (Megatron's
            default ``pre_softmax=False``; GPT-OSS). Softmax only.
        norm_topk_prob: renormalise the k selected weights to sum 1 (HF ``norm_topk_prob``).
            ``None`` (default) means True for k > 1 and False for k = 1: a single normalised
            weight is exactly 1 and the router would get no gradient from the task (Switch
            Transformer uses the unnormalised top-1 probability).
        routed_scaling_factor: multiplies the combine weights (DeepSeek-V3 ``routed_scaling_factor``).
        n_group, topk_group: group-limited routing (DeepSeek-V3): experts split into n_group
            equal groups; only the best topk_group groups are eligible.
        group_score: how a group is scored: ``"top2"`` = the sum of its two best scores
            (DeepSeek-V3's code and transformers' ``DeepseekV3TopkRouter``) or
            ``"topk_per_group"`` = the sum of its best ``top_k // topk_group`` scores
            (Megatron-Core ``group_limited_topk``). They agree only when
            ``top_k // topk_group == 2`` (DeepSeek-V3: k=8, topk_group=4).
        expert_bias: aux-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2): a
            per-expert bias added to the scores for selection only.
        bias_update_rate: γ of the bias update ``b += γ·sign(mean load − load)``.
        capacity_factor: None = dropless; otherwise capacity per expert
            ``ceil(T·k/E · capacity_factor)`` clamped to [1, T]; excess pairs are dropped.
        drop_policy: which pairs an over-full expert keeps: highest probability
            (``"probs"``) or earliest tokens (``"position"``). Megatron's
            ``moe_token_drop_policy``.
        jitter_eps: multiplicative input jitter U(1−eps, 1+eps) in training (Switch
            Transformer); 0 disables it.
        jitter_experts: the jittered input also feeds the experts, not only the router
            (transformers' Mixtral ``router_jitter_noise`` multiplies the hidden states
            before both); False = router only (Switch Transformer, Megatron).
        logit_noise_std: σ of additive Gaussian noise ``N(0, σ²)`` on the router logits in
            training (noisy top-k gating, Shazeer et al. 2017, arXiv 1701.06538; MoLF's gate
            uses σ = 0.01). The noisy logits drive the selection, the combine weights and the
            load-balancing probabilities alike; evaluation routes on clean logits (our choice,
            as Shazeer et al.). 0 disables it. Distinct from ``jitter_eps``, which multiplies
            the router *input*.
        input_size: width of the router's input when it routes on something other than the
            tokens it dispatches (a context router: text features steering time-series
            experts, a phase or task embedding); the layer is then called with
            ``router_input [..., input_size]`` (:meth:`moelab.core.layer.MoELayer.forward`).
            ``None`` = the experts' hidden size (route on the tokens themselves).
        force_uniform: benchmarking only: replace the learned selection by a round-robin
            assignment (token t takes experts ``(t·k + j) mod E``, j < k), so every expert gets
            the same number of pairs (±1). Combine weights still come from the router's
            scores at those experts. Megatron's ``moe_router_force_load_balancing`` uses random
            logits instead (balanced only in expectation); ours is exactly balanced and
            deterministic. Token choice only.
        usmoe_rate: USMoE only (``kind="usmoe"``; arXiv 2503.22996): r of the unified score
            ``w = (1−r)·softmax_E(ℓ) + r·f_alt(ℓ)``; the authors' code uses 0.5.
        usmoe_expert_score: f_alt: ``"sigmoid_scaled"`` = ``(2/E)·sigmoid(ℓ)`` (the released
            code), ``"softmax_over_tokens"`` (softmax of ℓ over the selection group's tokens,
            each token's row then renormalised over experts: the code's commented-out
            alternative) or ``"paper_expert_choice"`` (the paper's EC-style expert-dimension
            score as a secondary source gives it: the token softmax without renormalisation).
        budget_fraction: USMoE only: routed pairs per selection group =
            ``round(budget_fraction · k · T_group)`` (half up), met exactly; in (0, E/k].
        selection_scope: USMoE only: the group whose (token, expert) table is ranked:
            ``"position"`` (default: one time position across the batch, budget B·k — the
            authors' training-based code on ``[time, batch, D]`` tensors; causal),
            ``"sequence"`` (each row of the layer input's ``(B, S)``, the training-free code;
            looks at future tokens), ``"batch"`` (all T tokens; looks at future tokens) or
            ``"causal_prefix"`` (token t routed by the prefix 0..t only; causal; budget met on
            average, not exactly). Only :data:`CAUSAL_SCOPES` give a causal LM.
        usmoe_weight_norm: USMoE combine weights: ``"auto"`` (default: ``"none"``, except that
            :func:`moelab.models.with_router` picks ``"selected"`` for a model trained with
            normalised top-k weights so the swap keeps the output scale), ``"none"`` (w itself, the released code with
            ``norm_topk_prob=False``, which all three of its backbones use), ``"all_experts"``
            (w / Σ_e w, the code's ``norm_topk_prob`` branch) or ``"selected"`` (w / Σ over
            the token's selected experts; ours, matching a model trained with normalised top-k).
        usmoe_constraint: the LP's extra constraint: ``"global"`` (USMoE: only the budget),
            ``"per_token"`` (at most k experts per token: token choice at a budget) or
            ``"per_expert"`` (at most ceil(budget/E) tokens per expert: expert choice).
    """

    num_experts: int = 8
    top_k: int = 2
    kind: RouterKind = "token_choice"
    score_func: ScoreFunc = "softmax"
    softmax_before_topk: bool = True
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    group_score: GroupScore = "top2"
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    drop_policy: DropPolicy = "probs"
    jitter_eps: float = 0.0
    jitter_experts: bool = False
    logit_noise_std: float = 0.0
    input_size: int | None = None
    force_uniform: bool = False
    usmoe_rate: float = 0.5
    usmoe_expert_score: USMoEScore = "sigmoid_scaled"
    budget_fraction: float = 1.0
    selection_scope: SelectionScope = "position"
    usmoe_weight_norm: USMoEWeightNorm = "auto"
    usmoe_constraint: USMoEConstraint = "global"

    def __post_init__(self) -> None:
        check_fields(self)
        E, k = self.num_experts, self.top_k
        require(isinstance(E, int) and E >= 1, "num_experts", f"must be an int >= 1, got {E!r}")
        require(
            isinstance(k, int) and 1 <= k <= E,
            "top_k",
            f"must be in [1, num_experts={E}], got {k!r}",
        )
        require(
            self.kind in ("token_choice", "expert_choice", "usmoe", "sinkhorn"),
            "kind",
            f"must be token_choice, expert_choice, usmoe or sinkhorn, got {self.kind!r}",
        )
        require(
            self.score_func in ("softmax", "sigmoid", "sqrtsoftplus"),
            "score_func",
            f"must be softmax, sigmoid or sqrtsoftplus, got {self.score_func!r}",
        )
        if self.norm_topk_prob is None:
            self.norm_topk_prob = k > 1
        require(
            isinstance(self.norm_topk_prob, bool),
            "norm_topk_prob",
            f"must be a bool or None, got {self.norm_topk_prob!r}",
        )
        require(
            self.group_score in ("top2", "topk_per_group"),
            "group_score",
            f"must be top2 or topk_per_group, got {self.group_score!r}",
        )
        require(
            not self.force_uniform or self.kind == "token_choice",
            "force_uniform",
            f"needs kind='token_choice', got {self.kind!r}",
        )
        if (
            k == 1
            and E > 1
            and self.kind == "token_choice"
            and (
                self.norm_topk_prob
                or (self.score_func == "softmax" and not self.softmax_before_topk)
            )
        ):
            warnings.warn(
                "top_k=1 with normalised top-k weights: the single weight is exactly 1, so the "
                "router gets no gradient from the task loss (only from aux losses); set "
                "norm_topk_prob=False (softmax_before_topk=True) as Switch Transformer does",
                stacklevel=3,
            )
        require(
            self.drop_policy in ("probs", "position"),
            "drop_policy",
            f"must be probs or position, got {self.drop_policy!r}",
        )
        require(self.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
        require(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")
        require(0 <= self.jitter_eps < 1, "jitter_eps", f"must be in [0, 1), got {self.jitter_eps}")
        require(self.logit_noise_std >= 0, "logit_noise_std", "must be >= 0")
        require(
            self.input_size is None or self.input_size >= 1,
            "input_size",
            f"must be None or an int >= 1, got {self.input_size!r}",
        )
        if self.capacity_factor is not None:
            require(
                self.capacity_factor > 0,
                "capacity_factor",
                f"must be > 0 or None, got {self.capacity_factor}",
            )
        if self.kind in ("expert_choice", "sinkhorn"):
            require(
                self.n_group is None and not self.expert_bias,
                "kind",
                f"{self.kind} routing takes no group limits or expert bias",
            )
        self._check_usmoe()
        if (self.n_group is None) != (self.topk_group is None):
            raise InvalidValueError("n_group, topk_group: set both or neither")
        if self.n_group is not None:
            G, g = self.n_group, self.topk_group
            require(G >= 1 and E % G == 0, "n_group", f"must divide num_experts={E}, got {G}")
            require(1 <= g <= G, "topk_group", f"must be in [1, n_group={G}], got {g}")
            require(
                k <= g * (E // G),
                "top_k",
                f"{k} exceeds the {g * (E // G)} experts in topk_group={g} groups of {E // G}",
            )

    def _check_usmoe(self) -> None:
        E, k = self.num_experts, self.top_k
        if self.kind != "usmoe":
            defaults = {
                "usmoe_rate": 0.5,
                "usmoe_expert_score": "sigmoid_scaled",
                "budget_fraction": 1.0,
                "selection_scope": "position",
                "usmoe_weight_norm": "auto",
                "usmoe_constraint": "global",
            }
            # Configs written before these defaults changed stored the old ones for every
            # router; on a non-USMoE router they mean "unset", so read them as the new ones.
            for name, old in (("selection_scope", "sequence"), ("usmoe_weight_norm", "none")):
                if getattr(self, name) == old:
                    setattr(self, name, defaults[name])
            for name, default in defaults.items():
                require(
                    getattr(self, name) == default,
                    name,
                    f"only used by kind='usmoe', got {getattr(self, name)!r} with kind={self.kind!r}",
                )
            return
        require(
            0.0 <= self.usmoe_rate <= 1.0, "usmoe_rate", f"must be in [0, 1], got {self.usmoe_rate}"
        )
        require(
            self.usmoe_expert_score
            in ("sigmoid_scaled", "softmax_over_tokens", "paper_expert_choice"),
            "usmoe_expert_score",
            "must be sigmoid_scaled, softmax_over_tokens or paper_expert_choice, "
            f"got {self.usmoe_expert_score!r}",
        )
        require(
            0.0 < self.budget_fraction <= E / k,
            "budget_fraction",
            f"must be in (0, E/k={E / k:g}], got {self.budget_fraction}",
        )
        require(
            self.selection_scope in ("position", "sequence", "batch", "causal_prefix"),
            "selection_scope",
            f"must be position, sequence, batch or causal_prefix, got {self.selection_scope!r}",
        )
        require(
            self.usmoe_weight_norm in ("auto", "none", "all_experts", "selected"),
            "usmoe_weight_norm",
            f"must be auto, none, all_experts or selected, got {self.usmoe_weight_norm!r}",
        )
        require(
            self.usmoe_constraint in ("global", "per_token", "per_expert"),
            "usmoe_constraint",
            f"must be global, per_token or per_expert, got {self.usmoe_constraint!r}",
        )
        require(
            self.usmoe_constraint != "per_token" or self.budget_fraction <= 1.0,
            "budget_fraction",
            f"must be <= 1 with usmoe_constraint='per_token' (k per token), got {self.budget_fraction}",
        )
        require(
            self.selection_scope != "causal_prefix" or self.usmoe_constraint == "global",
            "usmoe_constraint",
            "causal_prefix selection supports only the global budget",
        )
        require(
            self.n_group is None and not self.expert_bias and self.capacity_factor is None,
            "kind",
            "usmoe takes no group limits, expert bias or capacity factor (the budget is the capacity)",
        )
        require(self.score_func == "softmax", "score_func", "usmoe's unified score uses softmax")


@dataclass
class ExpertsConfig:
    """The routed expert bank and optional shared experts.

    Attributes:
        hidden_size: D, model width.
        ffn_hidden_size: F, each routed expert's hidden width (Megatron ``moe_ffn_hidden_size``).
        activation: ``"swiglu"`` (gate/up/down), ``"gelu"`` (up/down MLP, exact erf GELU),
            ``"gelu_tanh"`` (up/down MLP, tanh-approximate GELU: HF ``gelu_pytorch_tanh``),
            ``"geglu"`` (gated, ``gelu_tanh(gate) ⊙ up``) or ``"swiglu_clamped"`` (GPT-OSS:
            ``(clamp(up, ±limit) + 1) ⊙ g·sigmoid(α·g)`` with ``g = min(gate, limit)``).
        swiglu_limit, swiglu_alpha: ``limit`` (7.0) and ``α`` (1.702) of ``"swiglu_clamped"``.
        bias: the routed experts' projections have biases (GPT-OSS ``gate_up_proj_bias``,
            ``down_proj_bias``): ``b_gate_up``/``b_up`` ``[E, width]`` and ``b_down [E, D]``.
        lora_rank: r of LoRA adapters on both stacked expert weights (Hu et al. 2021, arXiv
            2106.09685): ``W_e + (α/r)·A_e B_e`` per expert; 0 = none. See
            :mod:`moelab.models.lora`. At most ``min(hidden_size, ffn_hidden_size)``.
        lora_alpha: α of the LoRA scale ``α/r``.
        shared_expert_size: hidden width of an always-on shared expert (0 = none). Several
            DeepSeek-style shared experts are one shared expert of their summed width.
        shared_expert_gate: scale the shared expert by ``sigmoid(x·w)`` (Qwen2-MoE).
        init_std: std of the normal initialisation of the expert weights.
    """

    hidden_size: int = 256
    ffn_hidden_size: int = 512
    activation: Activation = "swiglu"
    shared_expert_size: int = 0
    shared_expert_gate: bool = False
    init_std: float = 0.02
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    bias: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.hidden_size >= 1, "hidden_size", f"must be >= 1, got {self.hidden_size}")
        require(
            self.ffn_hidden_size >= 1,
            "ffn_hidden_size",
            f"must be >= 1, got {self.ffn_hidden_size}",
        )
        require(
            self.activation in ("swiglu", "gelu", "gelu_tanh", "geglu", "swiglu_clamped"),
            "activation",
            f"must be swiglu, gelu, gelu_tanh, geglu or swiglu_clamped, got {self.activation!r}",
        )
        require(self.swiglu_limit > 0, "swiglu_limit", f"must be > 0, got {self.swiglu_limit}")
        require(
            isinstance(self.lora_rank, int) and self.lora_rank >= 0,
            "lora_rank",
            f"must be an int >= 0, got {self.lora_rank!r}",
        )
        full = min(self.hidden_size, self.ffn_hidden_size)
        require(
            self.lora_rank <= full,  # a larger rank adds parameters, not expressiveness
            "lora_rank",
            f"must be <= min(hidden_size, ffn_hidden_size) = {full}, got {self.lora_rank}",
        )
        require(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        require(self.shared_expert_size >= 0, "shared_expert_size", "must be >= 0")
        require(
            not self.shared_expert_gate or self.shared_expert_size > 0,
            "shared_expert_gate",
            "needs shared_expert_size > 0",
        )


@dataclass
class LossConfig:
    """Router losses and their coefficients (applied inside the layer).

    Attributes:
        load_balance: ``"switch"`` (per micro-batch; Fedus et al. 2021), ``"seq"``
            (per sequence; DeepSeek-V2/V3), ``"global"`` (counts summed over data-parallel
            ranks; Qiu et al. 2025, arXiv 2501.11873) or ``"none"``.
        aux_loss_coeff: α of the load-balancing loss.
        z_loss_coeff: coefficient of the router z-loss (ST-MoE, arXiv 2202.08906); 0 disables.
        convention: ``"megatron"``: f_i = count_i/(T·k), perfectly balanced routing gives
            1.0; ``"hf"``: transformers' ``load_balancing_loss_func``, f_i = count_i/T, balanced
            routing gives k.
        specialization: add the intra-layer specialization loss (arXiv 2602.14159; see
            :mod:`moelab.core.losses.specialization`), reported as ``"specialization"``.
        specialization_coeff: its coefficient (default 1e-3: the value the sweep of
            ``benchmarks/specialization.py`` over {1e-3, 1e-2, 1e-1} chose, with the loss a
            mean over ordered pairs [I]).
        specialization_penalty: φ of the cosine: ``"square"`` (cos², the paper's R_sp as
            secondary sources give it), ``"cos"`` or ``"relu"`` (max(cos, 0)).
        cross_layer: add the cross-layer dependency (coupling) loss between adjacent MoE
            layers (:mod:`moelab.core.losses.cross_layer`), reported as ``"cross_layer"``;
            computed by the model, not the layer.
        cross_layer_coeff: its coefficient.
        cross_layer_variant: ``"joint_topk"`` (default; the best available reading of the
            paper's Eq. 7: per token, the product of the two adjacent layers' top-k
            probability masses, maximised), or this project's variants ``"pathway"`` (batch
            joint routing distribution) and ``"token"`` (−log of the per-token product).
    """

    load_balance: BalanceLoss = "switch"
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    convention: BalanceConvention = "megatron"
    specialization: bool = False
    specialization_coeff: float = 1e-3
    specialization_penalty: SpecPenalty = "square"
    cross_layer: bool = False
    cross_layer_coeff: float = 1e-2
    cross_layer_variant: CrossLayerVariant = "joint_topk"

    def __post_init__(self) -> None:
        check_fields(self)
        require(
            self.load_balance in ("switch", "seq", "global", "none"),
            "load_balance",
            f"unknown load-balancing loss {self.load_balance!r}",
        )
        require(
            self.convention in ("megatron", "hf"),
            "convention",
            f"must be megatron or hf, got {self.convention!r}",
        )
        require(self.aux_loss_coeff >= 0, "aux_loss_coeff", "must be >= 0")
        require(self.z_loss_coeff >= 0, "z_loss_coeff", "must be >= 0")
        require(self.specialization_coeff >= 0, "specialization_coeff", "must be >= 0")
        require(self.cross_layer_coeff >= 0, "cross_layer_coeff", "must be >= 0")
        require(
            self.specialization_penalty in ("square", "cos", "relu"),
            "specialization_penalty",
            f"must be square, cos or relu, got {self.specialization_penalty!r}",
        )
        require(
            self.cross_layer_variant in ("joint_topk", "pathway", "token"),
            "cross_layer_variant",
            f"must be joint_topk, pathway or token, got {self.cross_layer_variant!r}",
        )


@dataclass
class MoEConfig:
    """One MoE feed-forward layer: router, experts, losses."""

    router: RouterConfig = field(default_factory=RouterConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    losses: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        # arXiv 2602.14159 defines R_sp on the SwiGLU intermediate silu(x·W_g) ⊙ (x·W_u).
        require(
            not self.losses.specialization or self.experts.activation == "swiglu",
            "losses.specialization",
            "is defined on SwiGLU expert activations (arXiv 2602.14159); "
            f"the experts use {self.experts.activation!r}",
        )
