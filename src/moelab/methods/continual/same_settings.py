"""SAME's knobs and those of its MoE-LoRA and LoRA baselines on the "text-MCIT" stream
(``wave3-continual.md`` §3; one field of :class:`~moelab.methods.continual.config.ContinualConfig`).

Labels: [C] the authors' code (LAMDA-CL/Prism @ 7154be2a: ``PEFT/tuners/custom/same.py``,
``config/methods/same.py``, ``method/custom/specialized_integration.py::RouterIntegration``),
[I] this project's choice (the research notes' text-MCIT spec, sizes scaled to MiniLM).
"""

from __future__ import annotations

from dataclasses import dataclass

from moelab.errors import require
from moelab.utils.fields import check_fields


@dataclass(frozen=True)
class SAMESettings:
    """SAME, MoELoRA and sequential LoRA on instruction tasks (all three share the loop).

    Adapter:
        num_experts: E; 0 means one per task (``expert_num = task_num`` [C]).
        rank, alpha: the total rank r (r/E per expert) and α; 20 / 40 [I: 64/128 at E = 8 in
            the CoIN config, scaled]. Sequential LoRA uses the same r and α.
        init_std: A ~ N(0, init_std²), B = 0 [C].
        lora_dropout: the baselines' ``lora_dropout`` (MoELoRA: on the router and A input;
            sequential LoRA: on the adapter input), 0.05 [C]; SAME configures it but never
            applies it [C], so it has none.
    Training (per task; a fresh AdamW and schedule per task, as each task is a new run [C]):
        epochs: 2 [I: the spec's text-MCIT]; the authors run 1.
        lr: 2e-3 [I: the tiny model needs more than the authors' 2e-4].
        weight_decay: 0 (the trainer's default [C]).
        warmup: linear warm-up fraction of the steps, then cosine to 0; 0.03 [C].
        logit_scale: answers are scored ``logit_scale · cos(feature, answer)`` [I].
        answer_template: the answer text of class c, ``template.format(label prompt of c)``;
            the label prompt (not the bare label) keeps the two "wisdom" classes apart [I].
    SAME's stabilisers [C] (each switchable for ablations):
        router_projection: the spectral router-gradient hook.
        curvature: the curvature hook on every expert's A (tasks >= 1).
        freezing: adaptive routing-mask freezing.
        start_step: the router hook is active from this many training forwards on, 10.
        refresh_every: the range finder re-estimates U, S every this many forwards, 20.
        max_components: range-finder width, min(64, in) [C: 64].
        energy_ratio: k* = #{cumulative energy <= energy_ratio} + 1; 0.9.
        window: trailing window smoothing S in the router hook, 3.
        router_scaling: c clamped to ``[1 - router_scaling, 1 + router_scaling]``, 0.2.
        curvature_mu: μ, 0.9 (the complement is scaled by 1/μ).
        tau_score: mask an expert when minmax(util) − minmax(importance) < tau_score; 0.1
            [C: the LLaVA/InternVL config; the code's own default is 1].
        ema: utilisation and importance EMA decay, 0.95.
        top_k: experts kept at inference, 2.
    Task prior (``RouterIntegration`` [C], text-only [I]):
        prior: route at inference with the prototype prior (False: π uniform).
        prior_scale: π = softmax(prior_scale · sim), 28.
        prior_text_weight: sim = w·cos(text) + (1 − w)·cos(image); 0.8. "Text" is the frozen
            embedding of instruction + input, the "image" stand-in that of the input alone [I].
    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    num_experts: int = 0
    rank: int = 20
    alpha: float = 40.0
    init_std: float = 0.01
    lora_dropout: float = 0.05
    epochs: int = 2
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup: float = 0.03
    logit_scale: float = 20.0
    answer_template: str = "answer: {}"
    router_projection: bool = True
    curvature: bool = True
    freezing: bool = True
    start_step: int = 10
    refresh_every: int = 20
    max_components: int = 64
    energy_ratio: float = 0.9
    window: int = 3
    router_scaling: float = 0.2
    curvature_mu: float = 0.9
    tau_score: float = 0.1
    ema: float = 0.95
    top_k: int = 2
    prior: bool = True
    prior_scale: float = 28.0
    prior_text_weight: float = 0.8

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.num_experts >= 0, "num_experts", f"must be >= 0, got {self.num_experts}")
        for name in ("rank", "epochs", "refresh_every", "max_components", "window", "top_k"):
            v = getattr(self, name)
            require(v >= 1, name, f"must be >= 1, got {v}")
        for name in ("alpha", "init_std", "lr", "logit_scale", "curvature_mu", "prior_scale"):
            v = getattr(self, name)
            require(v > 0, name, f"must be > 0, got {v}")
        for name in ("weight_decay", "start_step", "router_scaling"):
            v = getattr(self, name)
            require(v >= 0, name, f"must be >= 0, got {v}")
        for name in ("lora_dropout", "warmup", "ema"):
            v = getattr(self, name)
            require(0 <= v < 1, name, f"must be in [0, 1), got {v}")
        for name in ("energy_ratio", "prior_text_weight"):
            v = getattr(self, name)
            require(0 <= v <= 1, name, f"must be in [0, 1], got {v}")
        require(
            "{}" in self.answer_template,
            "answer_template",
            f"must contain {{}}, got {self.answer_template!r}",
        )
