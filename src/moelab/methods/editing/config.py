"""The editing recipe's settings: the edited site, each method's hyperparameters, the
GeoFacts benchmark's sizes (``shared/research/wave3-continual.md`` §4.2; labels: [S] the TIME
abstract, [C] LiveEdit's code, [I] this project's choice)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.errors import require
from moelab.utils.fields import check_fields

Method = Literal["time", "lora-key", "grace", "ft-l"]
METHODS: tuple[str, ...] = ("time", "lora-key", "grace", "ft-l")


@dataclass(frozen=True)
class EditConfig:
    """One editing run.

    Site:
        model: a run/model folder or a named pretrained model (``"smollm2"``); the benchmark
            loads it, the library takes a model object.
        layer: dotted name of the edited ``nn.Linear`` (default: the input of ``w_down`` in
            block 22 of SmolLM2's 30, d_in 1536 = 32 × 48, d_out 576; about 2/3 of the depth
            as LiveEdit [I]).
        method: ``"time"`` (CP-tensor experts, intrinsic routing), ``"lora-key"`` (a LoRA
            expert per edit + a stored key, cosine routing; LEMoE/LiveEdit-style),
            ``"grace"`` (ε-ball codebook), ``"ft-l"`` (fine-tune the layer).
        capacity: most edits one model may hold (more raise).

    TIME (the formalisation of ``methods-group3.md`` (d), all [I]; only the abstract is
    public):
        time_formalisation: ``"inferred"``, the only one: every TIME choice below is ours.
        rank: CP rank R (and the LoRA rank r of ``lora-key``): 4.
        factor_shape: ``(d1, d2)`` with ``d1·d2 = d_in`` (None: the most square pair, 32 × 48).
        alpha, beta: margins: negatives scored below ``alpha``, the edit above ``beta``;
            the firing threshold is ``(alpha + beta) / 2``.
        margin_weight: weight of both hinge terms (λ1 = λ2).
        negatives: unrelated prompts whose cached activations feed the negative hinge.

    Training (every method, one edit at a time, old edits frozen):
        steps: Adam steps per edit (15 [I]); lr: TIME and LoRA (1e-2 [I]).
        grace_lr, ft_lr: GRACE's value vector and FT-L's weight matrix (1.0, 1e-3 [I]).
        key_threshold: ``lora-key`` fires where cos(activation, key) ≥ this [I].
        grace_eps: GRACE fires where ‖a − key‖ ≤ grace_eps·‖key‖ (a relative ε [I]).

    Benchmark (GeoFacts):
        n_edits: edits in the stream (one LiveEdit chunk, scored after the whole stream [C]).
        n_neighbours: unedited countries per edit for neighbour locality.
        latency_repeats: timed passes of the evaluation set, edited and restored (median).

    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    model: str = "smollm2"
    layer: str = "blocks.22.ffn.w_down"
    method: Method = "time"
    capacity: int = 1000
    time_formalisation: Literal["inferred"] = "inferred"
    rank: int = 4
    factor_shape: tuple[int, int] | None = None
    alpha: float = 0.2
    beta: float = 0.6
    margin_weight: float = 1.0
    negatives: int = 64
    steps: int = 15
    lr: float = 1e-2
    grace_lr: float = 1.0
    ft_lr: float = 1e-3
    key_threshold: float = 0.9
    grace_eps: float = 0.5
    n_edits: int = 50
    n_neighbours: int = 2
    latency_repeats: int = 3

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("capacity", "rank", "steps", "n_edits", "n_neighbours", "latency_repeats"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.negatives >= 0, "negatives", f"must be >= 0, got {self.negatives}")
        require(
            0.0 <= self.alpha < self.beta,
            "alpha",
            f"must satisfy 0 <= alpha < beta, got alpha={self.alpha}, beta={self.beta}",
        )
        for name in ("margin_weight", "grace_eps"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "grace_lr", "ft_lr"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(
            -1.0 <= self.key_threshold <= 1.0,
            "key_threshold",
            f"must be a cosine in [-1, 1], got {self.key_threshold}",
        )
        require(
            self.factor_shape is None
            or (
                len(self.factor_shape) == 2
                and all(isinstance(d, int) and d >= 1 for d in self.factor_shape)
            ),
            "factor_shape",
            f"must be None or two ints >= 1, got {self.factor_shape!r}",
        )
        require(bool(self.layer), "layer", "must name a linear layer")

    @property
    def threshold(self) -> float:
        """TIME's firing threshold θ = (α + β) / 2 [I]."""
        return (self.alpha + self.beta) / 2
