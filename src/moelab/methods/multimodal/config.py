"""The EEG-MoCE recipe's settings: one dataclass for the arm, the model and the training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.errors import require
from moelab.utils.fields import check_fields

Arm = Literal["moce", "euclid", "fixed_k", "no_caf", "unimodal_hyp", "linear"]
ARMS: tuple[str, ...] = ("moce", "euclid", "fixed_k", "no_caf", "unimodal_hyp", "linear")
"""The six arms: EEG-MoCE, the Euclidean twin, fixed curvature, no curvature-aware fusion,
the unimodal hyperbolic (HEEGNet-like) and the linear unimodal references."""


@dataclass(frozen=True)
class EEGMoCEConfig:
    """One EEG-MoCE run. Defaults: the research spec's EEG-MoCE-lite
    (``wave3-science.md`` §1.3), with the authors' *effective* training values; tags as in the
    method page: [C] authors' code as it runs, [I] this project's choice.

    Arm:
        arm: ``"moce"`` (EEG-MoCE: learnable k per modality, curvature-aware fusion),
            ``"euclid"`` (same encoders, dot-product cross-attention, linear head),
            ``"fixed_k"`` (k frozen at ``k_init``), ``"no_caf"`` (no curvature-aware fusion:
            τ_m = τ_0, no prior), ``"unimodal_hyp"`` (modality A only, hyperbolic, fixed k),
            ``"linear"`` (modality A only, L2 logistic regression).

    Data (:mod:`moelab.data.eeg`):
        val_fraction: stratified share of training anchors for early stopping [C: 20 %].

    Encoder (per modality) [I, the spec's lite encoder]:
        filters: conv channels and step features D (16).
        kernel, depthwise_kernel: the temporal conv (15) and depthwise conv (7) widths.
        steps: adaptive-pool length S (16).
        dropout: after the first block (0.25 [C]).

    Hyperbolic stack and fusion:
        k_init: initial Lorentz parameter of every modality, curvature −1/k [C: 0.5].
        pool: Lorentz centroid-pool window over the steps (4; [C] uses 8 over 64 steps).
        max_radius: the vendored geoopt's exp-map radius clamp [C: 10].
        fusion_heads, fusion_hidden, fusion_layers: cross-attention heads, width D', layers
            [I: 2, 32, 1; C: 4, 64, 2].
        prior_init: initial λ of the curvature prior [C: 0.3 in ``main``].

    Training [C unless noted]:
        lr: Adam learning rate (1e-3), also the curvatures' (scale 1.0; the warm-up never runs).
        weight_decay: Adam's coupled L2 on every non-curvature parameter: the code's effective
            1e-3 (its ``cfg['weight_decay']=1e-4`` never reaches the optimiser); curvatures 0.
        curvature_clip: grad-norm clip of each manifold's k (1.0); k clamped ≥ ``k_min`` (1e-5).
        batch_size: 50. max_epochs, min_epochs, patience: ≤ 100 epochs, no stop before 70,
            patience 20 on validation loss; the best-validation state is restored.
        bn_refit: refit the encoders' BatchNorm statistics on the whole test split before
            testing [I: the code refits its Lorentz domain BN per test subject; the lite model
            has no Lorentz BN].

    Linear reference [I]:
        linear_factor: block-mean factor on A's 224 samples (4 → 56 per channel).
        linear_l2: L2 penalties of the logistic regression (on the mean loss) tried; the one
            with the best validation balanced accuracy is refitted on train + validation.

    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    arm: Arm = "moce"
    val_fraction: float = 0.2
    filters: int = 16
    kernel: int = 15
    depthwise_kernel: int = 7
    steps: int = 16
    dropout: float = 0.25
    k_init: float = 0.5
    pool: int = 4
    max_radius: float = 10.0
    fusion_heads: int = 2
    fusion_hidden: int = 32
    fusion_layers: int = 1
    prior_init: float = 0.3
    lr: float = 1e-3
    weight_decay: float = 1e-3
    curvature_clip: float = 1.0
    k_min: float = 1e-5
    batch_size: int = 50
    max_epochs: int = 100
    min_epochs: int = 70
    patience: int = 20
    bn_refit: bool = True
    linear_factor: int = 4
    linear_l2: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (
            "filters",
            "kernel",
            "depthwise_kernel",
            "steps",
            "pool",
            "fusion_heads",
            "fusion_hidden",
            "fusion_layers",
            "batch_size",
            "max_epochs",
            "patience",
            "linear_factor",
        ):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(
            0 <= self.min_epochs <= self.max_epochs,
            "min_epochs",
            f"must be in [0, max_epochs={self.max_epochs}], got {self.min_epochs}",
        )
        require(self.pool <= self.steps, "pool", f"must be <= steps={self.steps}, got {self.pool}")
        require(
            0 < self.val_fraction < 1, "val_fraction", f"must be in (0, 1), got {self.val_fraction}"
        )
        require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        for name in ("k_init", "max_radius", "prior_init", "lr", "curvature_clip", "k_min"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(
            len(self.linear_l2) > 0
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")
                for v in self.linear_l2
            ),
            "linear_l2",
            f"must be finite numbers >= 0, got {self.linear_l2!r}",
        )
        require(
            self.k_min <= self.k_init, "k_min", f"must be <= k_init={self.k_init}, got {self.k_min}"
        )
