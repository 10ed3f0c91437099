"""Settings of one continual-learning run: the stream, the backbone placement, the method and
its training schedule (CaRE's authors' defaults where they apply).

Labels as in ``wave3-continual.md`` §1: [C] the authors' code (LMMMEng/CaRE @ d90800a0,
``exps/omnibenchmark1k/care_ob1k_b100inc3.json``, the long-sequence config), [I] this
project's choice (mostly sizes scaled from ViT-B's D = 768 to MiniLM's D = 384).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moelab.errors import require
from moelab.methods.continual.moram_config import MoRAMSettings
from moelab.methods.continual.same_settings import SAMESettings
from moelab.methods.continual.upcycling_settings import UPCYCLING_ARMS, UpcyclingSettings
from moelab.utils.fields import check_fields

Method = Literal[
    "care",
    "simplecil",
    "aper",
    "finetune",
    "seqft-replay",
    "full-upcycling",
    "selective-upcycling",
    "same",
    "moelora",
    "seqlora",
    "moram",
    "prompt-moe-lora",
    "prompt-seq-lora",
    "zeroshot",
]
INSTRUCTION_METHODS = ("same", "moelora", "seqlora")
"""Methods of the instruction-tuning protocol (:mod:`~moelab.methods.continual.same`)."""
PROMPT_METHODS = ("moram", "prompt-moe-lora", "prompt-seq-lora", "zeroshot")
"""Label-prompt classifiers of the X-TAIL protocol (:mod:`~moelab.methods.continual.moram`)."""
METHODS: tuple[str, ...] = (
    "care", "simplecil", "aper", "finetune", *UPCYCLING_ARMS, *INSTRUCTION_METHODS,
    *PROMPT_METHODS,
)  # fmt: skip
StreamName = Literal["wordnet", "synthetic", "domains", "synthetic-domains"]
DOMAIN_STREAMS = ("domains", "synthetic-domains")
"""Streams with one task per domain (the rest are class-incremental over one labelled set)."""
Scenario = Literal["class", "task", "domain"]


@dataclass(frozen=True)
class ContinualConfig:
    """One run of one method on one stream.

    Stream:
        stream: ``"wordnet"`` (WordNet depth-5 hypernym classes, Debian ``wordnet-base``),
            ``"synthetic"`` (random token texts, for tests), ``"domains"`` (one task per
            real text domain of :mod:`~moelab.methods.continual.domains`, 5 tasks, 78
            classes) or ``"synthetic-domains"`` (3 synthetic domains of 4 classes, for tests).
        scenario: ``"class"`` (task-agnostic test over every seen class; class-incremental
            streams), ``"task"`` (the task id is given at test: prediction among that task's
            classes) or ``"domain"`` (X-TAIL: the joint label space, every task tested
            after every step; domain streams).
        num_classes: classes used, the largest ones (108 [I]: the note's WordNet-108);
            class-incremental streams only.
        num_tasks, classes_per_task: B0-Inc2, 54 tasks [I: the long-sequence regime];
            class-incremental streams only (a domain stream has one task per domain).
        train_per_class, test_per_class: 40 / 10 per class, seeded [I].
        max_tokens: tokens kept per text ([CLS] and [SEP] included) [I].

    Backbone:
        adapted_blocks: the top blocks that carry adapters; the lower ones are computed once
            and cached (2 [I]; the authors adapt every block of ViT-B).
        routing_token: ``"mean"`` (mean-pooled expert output [I]: MiniLM is a mean-pooling
            encoder) or ``"cls"`` (the authors' CLS token).

    Method:
        method: ``"care"``, ``"simplecil"``, ``"aper"``, ``"finetune"``, ``"same"``,
            ``"moelora"`` or ``"seqlora"``.
        expert_dim, shared_dim: expert and shared-adapter bottlenecks (authors at D = 768: 16
            and 64 [C]; halved with D [I]).
        adapter_dim: bottleneck of APER's and fine-tuning's adapter (PILOT's APER: 64 at
            D = 768; halved [I]).
        topk_experts, topk_routers: 3 and 2 [C].
        scale, margin: cosine-logit scale s = 20 and CosFace margin m = 0 [C].
        ema_decay: pin of the shared adapter, 0.999 [C].
        adapter_dropout: 0.1 [C].
        decay: class-mean decay in classifier alignment (on in the long-sequence configs [C]).
        self_distill: the latent heads' KL term to the unscaled cosine teacher [C].
        same: the knobs of ``"same"``, ``"moelora"`` and ``"seqlora"`` (SAME and its
            baselines on instruction tasks, :class:`~moelab.methods.continual.same_settings.SAMESettings`).
        moram: MoRAM's knobs and its label-prompt baselines' schedule (``"moram"``,
            ``"prompt-moe-lora"``, ``"prompt-seq-lora"``, ``"zeroshot"``; :class:`MoRAMSettings`).

    Training:
        first_task_epochs: epochs on task 0 (authors' OB1K: 20 [C]; 10 [I]).
        epochs: epochs on every later task, as two halves (CaRE: lr → lr/2, alignment, then
            lr/2 → 0, alignment [C]; authors' OB1K: 20 [C]; 6 [I]).
        batch_size, lr, weight_decay: 16, 0.01, 5e-4 (SGD, momentum 0.9) [C].
        ca_epochs, ca_lr: classifier alignment, 3 epochs at 0.005 [C]; 5·batch_size
            samples per class and epoch [C].
        upcycling: the upcycling arms' settings (``seqft-replay``, ``full-upcycling``,
            ``selective-upcycling``; :class:`~moelab.methods.continual.upcycling_settings.
            UpcyclingSettings`); their batches are ``batch_size`` task texts.
    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    stream: StreamName = "wordnet"
    scenario: Scenario = "class"
    num_classes: int = 108
    num_tasks: int = 54
    classes_per_task: int = 2
    train_per_class: int = 40
    test_per_class: int = 10
    max_tokens: int = 32
    adapted_blocks: int = 2
    routing_token: Literal["mean", "cls"] = "mean"
    method: Method = "care"
    expert_dim: int = 8
    shared_dim: int = 32
    adapter_dim: int = 32
    topk_experts: int = 3
    topk_routers: int = 2
    scale: float = 20.0
    margin: float = 0.0
    ema_decay: float = 0.999
    adapter_dropout: float = 0.1
    decay: bool = True
    self_distill: bool = True
    first_task_epochs: int = 10
    epochs: int = 6
    batch_size: int = 16
    lr: float = 0.01
    weight_decay: float = 5e-4
    ca_epochs: int = 3
    ca_lr: float = 0.005
    upcycling: UpcyclingSettings = field(default_factory=UpcyclingSettings)
    same: SAMESettings = field(default_factory=SAMESettings)
    moram: MoRAMSettings = field(default_factory=MoRAMSettings)

    def __post_init__(self) -> None:
        for name, cls in (
            ("upcycling", UpcyclingSettings),
            ("same", SAMESettings),
            ("moram", MoRAMSettings),
        ):
            value = getattr(self, name)
            if isinstance(value, dict):  # read back from a saved run's JSON (tuples as lists)
                value = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
                object.__setattr__(self, name, value)
            require(
                isinstance(value, cls),
                name,
                f"must be a {cls.__name__}, got {type(value).__name__}",
            )
        check_fields(self)
        for name in (
            "num_classes",
            "num_tasks",
            "classes_per_task",
            "train_per_class",
            "test_per_class",
            "adapted_blocks",
            "expert_dim",
            "shared_dim",
            "adapter_dim",
            "topk_experts",
            "topk_routers",
            "first_task_epochs",
            "batch_size",
        ):
            v = getattr(self, name)
            require(v >= 1, name, f"must be >= 1, got {v}")
        require(self.max_tokens >= 3, "max_tokens", f"must be >= 3, got {self.max_tokens}")
        domains = self.stream in DOMAIN_STREAMS
        allowed = ("domain", "task") if domains else ("class", "task")
        require(
            self.scenario in allowed,
            "scenario",
            f"must be {' or '.join(allowed)} on the {self.stream} stream, got {self.scenario!r}",
        )
        require(
            domains or self.method not in INSTRUCTION_METHODS,
            "method",
            f"{self.method} answers with label prompts: use a domain stream, not {self.stream}",
        )
        require(
            domains or self.num_tasks * self.classes_per_task <= self.num_classes,
            "num_tasks",
            f"{self.num_tasks} tasks x {self.classes_per_task} classes need "
            f"{self.num_tasks * self.classes_per_task} classes, the stream has num_classes="
            f"{self.num_classes}",
        )
        require(self.epochs >= 2, "epochs", f"must be >= 2 (two halves), got {self.epochs}")
        for name in ("ca_epochs",):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("scale", "lr", "ca_lr"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("margin", "weight_decay"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(0 <= self.ema_decay <= 1, "ema_decay", f"must be in [0, 1], got {self.ema_decay}")
        require(
            0 <= self.adapter_dropout < 1,
            "adapter_dropout",
            f"must be in [0, 1), got {self.adapter_dropout}",
        )
