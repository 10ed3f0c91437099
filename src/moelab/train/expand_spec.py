"""SPARKLING expansion specs: the ``ExpandSpec`` dataclass, the factor parsers of the CLI
and the grown ``ModelConfig`` (which widths grow, SPARKLING §3.3 [P]). The method is described
in :mod:`moelab.train.expand`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moelab.errors import InvalidValueError
from moelab.models import ModelConfig
from moelab.train.config import TrainConfig

INITS = ("sparkling", "random", "naive", "copy")
STATES = ("asymmetric", "scaled", "symmetric")
REWARM_TAILS = ("base", "own")
REWARM_RATIO = 1.3
"""The paper's re-warmup peak ratio ρ (§4.2.2, App. G–H: best region ρ ≈ 1.25–1.3)."""
PAPER_REWARM_STEPS = 250
"""The paper's re-warmup length τ_w in steps (§4.2.2, about 0.8 % of its ≈ 31.8k steps after
the expansion [I: our arithmetic from App. D])."""


def default_rewarm_steps(steps_left: int) -> int:
    """Default re-warmup length τ_w for ``steps_left`` optimizer steps after the expansion:
    ``min(250, max(1, round(0.008 · steps_left)))``.

    The paper uses τ_w = 250 [P] in a run with ≈ 31.8k steps after the expansion, i.e.
    ≈ 0.8 % of them; for shorter runs we keep that fraction (250 steps would outlast a short
    run's remaining schedule) and never exceed 250 [I]."""
    return min(PAPER_REWARM_STEPS, max(1, round(0.008 * steps_left)))


@dataclass(frozen=True)
class ExpandSpec:
    """One width expansion.

    Attributes:
        hidden: factor (> 1) of d_model (heads and head_dim kept), or None.
        inner: factor (> 1) of the expert / shared-expert / dense-FFN inner width, or None.
        init: ``sparkling`` (the paper's copy-copy), ``random``, ``naive`` or ``copy``.
        state: ``asymmetric`` (the paper's), ``scaled`` or ``symmetric`` optimizer state.
        rewarm_steps: τ_w, re-warmup steps of the new entries' groups (asymmetric and
            scaled only; 0 = no re-warmup with ``rewarm_tail="base"``, a jump straight to
            ``ρ·η_e`` and its own decay from there with ``"own"``).
        rewarm_ratio: ρ, the new groups' re-warmup peak over the rate at the expansion
            (paper: 1.3; 1 is no boost).
        rewarm_tail: after the rise, ``"base"``: fall back to the base schedule over another
            ``rewarm_steps`` and follow it (a short re-warmup [I]; with ``rewarm_ratio`` 1 or
            ``rewarm_steps`` 0 the new entries run exactly on the base schedule); ``"own"``:
            their own cosine from ``ρ·η_e`` to the base minimum (moelab's reading of Eq. 28;
            the new entries then stay above the old ones' rate to the end).
    """

    hidden: float | None = None
    inner: float | None = None
    init: str = "sparkling"
    state: str = "asymmetric"
    rewarm_steps: int = 0
    rewarm_ratio: float = REWARM_RATIO
    rewarm_tail: str = "base"

    def __post_init__(self) -> None:
        for name in ("hidden", "inner"):
            f = getattr(self, name)
            if f is not None and not (isinstance(f, (int, float)) and math.isfinite(f) and f > 1):
                raise InvalidValueError(
                    f"{name}: a width factor must be a finite number > 1 (no shrinking), got {f!r}"
                )
        if self.hidden is None and self.inner is None:
            raise InvalidValueError("expand: give a hidden and/or an expert (inner) factor")
        if self.init not in INITS:
            raise InvalidValueError(f"init: must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.state not in STATES:
            raise InvalidValueError(
                f"state: must be one of {', '.join(STATES)}, got {self.state!r}"
            )
        if not isinstance(self.rewarm_steps, int) or self.rewarm_steps < 0:
            raise InvalidValueError(f"rewarm_steps: must be an int >= 0, got {self.rewarm_steps!r}")
        if self.rewarm_tail not in REWARM_TAILS:
            raise InvalidValueError(
                f"rewarm_tail: must be one of {', '.join(REWARM_TAILS)}, got {self.rewarm_tail!r}"
            )
        r = self.rewarm_ratio
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise InvalidValueError(f"rewarm_ratio: must be a finite number > 0, got {r!r}")

    @classmethod
    def from_train_config(cls, cfg: TrainConfig) -> ExpandSpec:
        """The expansion ``cfg`` asks for at ``cfg.expand_at`` (default re-warmup length:
        :func:`default_rewarm_steps` of the steps left)."""
        left = cfg.steps - (cfg.expand_at or 0)
        rewarm = cfg.rewarm_steps if cfg.rewarm_steps is not None else default_rewarm_steps(left)
        return cls(
            hidden=cfg.expand_hidden,
            inner=cfg.expand_expert,
            init=cfg.expand_init,
            state=cfg.expand_state,
            rewarm_steps=rewarm,
            rewarm_ratio=cfg.rewarm_ratio,
            rewarm_tail=cfg.rewarm_tail,
        )


def parse_factor(text: str, name: str = "factor") -> float:
    """``"2x"``, ``"2"``, ``"1.5x"`` → the number. Raises ValueError naming ``name``."""
    s = str(text).strip().lower().removesuffix("x")
    try:
        f = float(s)
    except ValueError:
        raise InvalidValueError(
            f"{name}: expected a factor like 2x or 1.5x, got {text!r}"
        ) from None
    if not (math.isfinite(f) and f > 1):
        raise InvalidValueError(
            f"{name}: a width factor must be a finite number > 1 (no shrinking), got {text!r}"
        )
    return f


def parse_expand(text: str) -> dict[str, float]:
    """``"hidden=2x,expert=2x"`` → ``{"hidden": 2.0, "expert": 2.0}`` (either key may be
    left out). Raises ValueError on unknown axes, repeats or bad factors."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("hidden", "expert"):
            raise InvalidValueError(
                f"--expand: expected hidden=F and/or expert=F (e.g. hidden=2x,expert=2x), got {text!r}"
            )
        if key in out:
            raise InvalidValueError(f"--expand: {key} given twice")
        out[key] = parse_factor(value, f"--expand {key}")
    return out


def _scaled(n: int, f: float | None, what: str) -> int:
    if f is None:
        return n
    v = n * f
    if abs(v - round(v)) > 1e-9:
        raise InvalidValueError(f"{what}: factor {f:g} turns {n} into {v:g}, not a whole number")
    return round(v)


def expanded_config(cfg: ModelConfig, hidden: float | None, inner: float | None) -> ModelConfig:
    """The config after the expansion (see the module docstring for what grows): ``d_model``
    times ``hidden``, with ``n_heads``, ``n_kv_heads`` and ``head_dim`` kept (SPARKLING §3.3),
    and the inner widths times ``inner``. ``logit_scale`` is set by :func:`expand_model`.

    Raises:
        InvalidValueError: a factor that leaves a fractional width.
    """
    d = _scaled(cfg.d_model, hidden, "hidden: d_model")
    moe = cfg.moe
    if moe is not None:
        ex = moe.experts
        ex = dataclasses.replace(
            ex,
            hidden_size=d,
            ffn_hidden_size=_scaled(ex.ffn_hidden_size, inner, "expert: ffn_hidden_size"),
            shared_expert_size=_scaled(ex.shared_expert_size, inner, "expert: shared_expert_size"),
        )
        moe = dataclasses.replace(moe, experts=ex)
    return dataclasses.replace(
        cfg,
        d_model=d,
        head_dim=cfg.head_dim,
        dense_ffn_size=(
            _scaled(cfg.dense_ffn_size, inner, "expert: dense_ffn_size")
            if cfg.num_moe_layers < cfg.n_layers
            else cfg.dense_ffn_size
        ),
        moe=moe,
    )
