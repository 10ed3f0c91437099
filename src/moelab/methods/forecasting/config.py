"""The TiMi recipe's settings: one dataclass for the data, the arm, the model and training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moelab.data.forecast_events import VARIANTS, WEEK
from moelab.errors import require
from moelab.methods.forecasting.text import TEXT_ENCODERS
from moelab.utils.fields import check_fields

Arm = Literal["unimodal", "concat", "mmoe", "tmoe", "smoe", "shuffled"]
ARMS: tuple[Arm, ...] = ("mmoe", "unimodal", "concat", "tmoe", "smoe", "shuffled")
TEXT_ARMS = ("concat", "mmoe", "tmoe", "shuffled")
Variant = Literal["whole", "partial"]


@dataclass(frozen=True)
class ForecastConfig:
    """One TiMi run (defaults: the PatchTST-lite reproduction of
    ``shared/research/wave3-science.md`` §2.4; [S] the paper's description, [I] ours).

    Data:
        data_path: a user CSV of ``timestamp,value,text`` (None: the real ``taylor`` series
            with injected, announced events; :mod:`moelab.data.forecast_events`).
        variant: ``"whole"``-horizon regime events or ``"partial"``-horizon ones (taylor only).
        lookback, horizon, stride: window sizes in steps (336 = 7 days, 48 = 1 day, 4).
        event_probability: share of taylor windows with an event (0.35).

    Text:
        text_encoder: ``"smollm2"`` (frozen SmolLM2-135M, mean-pooled; [S] a frozen LLM) or
            ``"minilm"`` (the ablation).
        text_cache: a ``.safetensors`` file keeping the encoded strings between runs (None:
            memory only).

    Model:
        arm: ``"mmoe"`` (TiMi: TMoE + SMoE in every block's FFN slot), ``"unimodal"``
            (PatchTST-lite), ``"concat"`` (the projected text token appended as an extra
            token), ``"tmoe"`` / ``"smoe"`` (one of the two MoEs), ``"shuffled"`` (MMoE with
            the texts permuted across windows: a control).
        patch_len, patch_stride: 16 and 8 (41 tokens for 336 steps; PatchTST).
        d_model, n_heads, n_layers: 32, 4, 2 (post-LN blocks) [I, CPU scale].
        dropout: after attention and the FFN slot [I].
        num_experts, top_k: E = 4, k = 2 per MoE, softmax over the selected logits [I].
        aux_loss_coeff: Switch balance-loss weight per MoE (1e-2) [I].

    Training:
        epochs, batch_size, lr, weight_decay: Adam(W), the best validation epoch kept [I].

    Raises (construction):
        InvalidValueError: a field of the wrong type or out of range (named).
    """

    data_path: str | None = None
    variant: Variant = "whole"
    lookback: int = WEEK
    horizon: int = 48
    stride: int = 4
    event_probability: float = 0.35
    text_encoder: str = "smollm2"
    text_cache: str | None = None
    arm: Arm = "mmoe"
    patch_len: int = 16
    patch_stride: int = 8
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.1
    num_experts: int = 4
    top_k: int = 2
    aux_loss_coeff: float = 1e-2
    epochs: int = 40
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (
            "lookback",
            "horizon",
            "stride",
            "patch_len",
            "patch_stride",
            "d_model",
            "n_heads",
            "n_layers",
            "num_experts",
            "epochs",
            "batch_size",
        ):
            v = getattr(self, name)
            require(v >= 1, name, f"must be >= 1, got {v}")
        require(self.arm in ARMS, "arm", f"must be one of {', '.join(ARMS)}, got {self.arm!r}")
        require(
            self.variant in VARIANTS,
            "variant",
            f"must be one of {', '.join(VARIANTS)}, got {self.variant!r}",
        )
        require(
            self.text_encoder in TEXT_ENCODERS,
            "text_encoder",
            f"must be one of {', '.join(TEXT_ENCODERS)}, got {self.text_encoder!r}",
        )
        require(
            1 <= self.top_k <= self.num_experts,
            "top_k",
            f"must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        require(
            self.d_model % self.n_heads == 0,
            "n_heads",
            f"must divide d_model={self.d_model}, got {self.n_heads}",
        )
        require(
            self.patch_len <= self.lookback,
            "patch_len",
            f"must be <= lookback={self.lookback}, got {self.patch_len}",
        )
        require(
            self.data_path is not None or self.lookback >= WEEK,
            "lookback",
            f"the taylor events need >= {WEEK} steps (a week), got {self.lookback}",
        )
        require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(
            0.0 <= self.event_probability <= 1.0,
            "event_probability",
            f"must be in [0, 1], got {self.event_probability}",
        )
        for name in ("aux_loss_coeff", "weight_decay"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")

    @property
    def num_patches(self) -> int:
        """Series tokens per window: ``(lookback − patch_len) // patch_stride + 1``."""
        return (self.lookback - self.patch_len) // self.patch_stride + 1

    @property
    def uses_text(self) -> bool:
        """The arm reads the text token (concat and the text-routed arms)."""
        return self.arm in TEXT_ARMS
