"""SPARKLING mid-training width expansion of a live model and its optimizer.

SPARKLING: Balancing Signal Preservation and Symmetry Breaking for Width-Progressive Learning
(Yu et al., ICML 2026, arXiv 2602.02472, read from the v2 full text; no official code). The
recipe (§5): "(i) RMS-preserving scaling, (ii) copy-based initialization, (iii) asymmetric
optimizer state reset, and (iv) an asymmetric learning rate re-warmup schedule". Tags: [P] =
stated by the paper, [I] = this project's choice where the paper is silent.

Axes (``hidden`` factor ``f``, ``inner`` factor ``g``):

- hidden: ``d_model → f·d_model`` "leaving the head dimension and the numbers of QKV heads
  unchanged" (§3.3) [P]: q/k/v (and the routers [I], the shared-expert gate [I]) grow only
  their input columns (fan-in); ``o_proj``, the FFNs'/experts' down projections and the
  embedding grow only their rows along D (fan-out); every RMSNorm over D grows; the LM head
  is fan-in. ``n_heads``, ``n_kv_heads``, ``head_dim`` (so RoPE and any q/k norm) are kept,
  so attention costs the same [P]. ``head_dim`` is written explicitly into the new config.
- inner: every expert's inner width ``F → g·F`` (gate and up blocks grow separately, both
  fan-out, down fan-in: "the up and gate projections become fan-out expansions, and the
  subsequent down projection becomes fan-in", §3.2 [P]), and with it the shared expert's and
  the dense FFNs' inner widths (a dense model's "expert inner size" is its FFN width [I]).

Initialisations (``init``):

- ``sparkling`` (the paper's method, "SPARKLING ultimately defaults to copy-copy
  initialization", §4 [P]): every new row, column, embedding column and RMSNorm gain is a
  copy of an old one (unit ``j`` copies ``j mod n_old`` inside each block [I], Net2Net's
  mapping) with no rescaling on fan-out (§3.2.2, §3.2.4, App. C [P]). Every matrix whose
  input grew is multiplied, *all* entries including the old ones, by the analytic constant of
  Eq. 16 (:func:`fan_in_scale`, both sides copied): ``1/√(1+3c)`` for ``d'_in = (1+c)·d_in``,
  ``c ≤ 1``, and ``1/(1+c)`` for ``c > 1`` — ½ at 2×, where the expanded model computes the
  same function as before [P, Eq. 16; function preservation at 2× is the algebra]. No
  calibration batch [P]. Biases (q/k/v ``attention_bias``; the paper has none) would be
  copied unscaled [I]; with the heads kept they never grow. Tied embeddings: the shared
  matrix is fan-out as the embedding, so it is copied unscaled, and the head's fan-in factor
  becomes a fixed (not trained [I]) ``ModelConfig.logit_scale`` on the logits ("multiplying
  the corresponding coefficient after the final output projection", App. D.1 [P]).
- ``random`` (moelab's earlier reading, kept as the paper's *random-random* ablation, Fig. 1
  and 6, though with a fitted instead of analytic scale [I]): old entries keep their values;
  new matrix/embedding/bias entries are drawn from ``N(0, rms(W_old)²)`` (per expert for
  expert banks; biases [I]); new RMSNorm gains are the mean of the old gains. Every matrix
  whose input grew is then multiplied by one scalar ``c`` (per expert for banks; its bias
  too) fitted on a calibration batch so that the RMS of its output equals the old model's
  (``c ≈ 1/√f``, the paper's Eq. 14 ``√(d_in/d'_in)``). ``c`` is fitted in forward order in
  one pass. With tied embeddings the LM head's ``c`` goes on the final norm's gains.
- ``naive``: new entries take the values a freshly built model of the new width has
  (:meth:`MoETransformer.reset_parameters`: ``N(0, init_std²)``, residual projections
  ``init_std/√(2L)``, gains 1, biases 0); old entries unchanged. (The paper's naive init
  samples from the trained weights' distribution instead; a baseline difference.)
- ``copy``: plain function preserving copy. Net2Net (Chen et al. 2016, arXiv 1511.05641) for
  inner widths: new unit ``j`` copies unit ``j mod F`` and the weights that read the units
  are divided by the number of copies; HyperCloning (Samragh et al. 2024, arXiv 2409.12903)
  for the hidden size: the residual stream becomes ``[x, x]``, every matrix reading D divided
  by ``f``. Needs a whole hidden factor. With tied embeddings the final norm's gains are
  divided by ``f``. At factors 2 and 3 its weights equal ``sparkling``'s (3× only for
  fan-in ``1/(1+c) = 1/3``) except for the tied head (norm gains vs ``logit_scale``); at
  other factors ``sparkling`` scales uniformly and preserves RMS, not the function [P].

Optimizer state (``state``; :mod:`moelab.train.optim` keeps each region as its own shard):

- ``asymmetric`` (SPARKLING, §4.2.1 Eq. 24 [P]: "retaining the optimizer states for the
  original W and resetting the states for the new parameters"): old entries keep their state
  *unscaled* [P: scaling it "yields no additional gain"]; new entries are new shards in new
  parameter groups with no state: moments 0, and their own Adam bias-correction step counter
  from 0 [I: the paper does not say]. Muon: each shard is orthogonalised on its own [I: the
  paper orthogonalises the one matrix ``[S, 0]``]. The new groups follow the asymmetric
  re-warmup (:func:`moelab.train.schedule.rewarm_lr_at`, §4.2.2 Eq. 25–28 [P]): they start
  at the current rate ``η_e = η(t_e)``, rise linearly to ``ρ·η_e`` over ``τ_w`` steps
  (``rewarm_ratio`` ρ = 1.3, ``rewarm_steps`` τ_w = 250 in the paper [P]) and then follow
  their own cosine to the base schedule's minimum at the last step; old groups stay on the
  base schedule [P].
- ``scaled``: ``asymmetric`` but old entries' state scaled as their weights were
  (Adam ``m·s``, ``v·s²``, Muon momentum ``·s``; Shen et al. 2022), the ablation the paper
  found no better; moelab's earlier default.
- ``symmetric`` (the baselines' usual practice): the new entries join as if they had always
  been there: one step counter with the old entries, moments copied from their source entry
  for the copy-based inits (``sparkling``, ``copy``; scaled like the weights) or zero
  (``random``, ``naive``), old entries' state scaled like their weights, no re-warmup.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.config import GATED_ACTIVATIONS
from moelab.core.experts.bank import SharedExpert
from moelab.core.layer import MoELayer
from moelab.core.routers.base import Router
from moelab.data import TokenStream, sample_batch
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models import ModelConfig, MoETransformer
from moelab.models.memory import check_model_fits
from moelab.train.config import TrainConfig
from moelab.train.expand_axes import Axis, ParamPlan, Region, full_region
from moelab.train.optim import ShardedOptimizer, region_slices
from moelab.train.schedule import scheduled_lr

INITS = ("sparkling", "random", "naive", "copy")
STATES = ("asymmetric", "scaled", "symmetric")
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


def fan_in_scale(d_in: int, d_in_new: int, copied: bool = True) -> float:
    """The analytic RMS-preserving factor of a fan-in (input-growing) matrix, applied to all
    its entries (old and new): ``W' = α·[W, W̃]`` (SPARKLING §3.2.3).

    Args:
        d_in, d_in_new: input width before and after (``d_in_new > d_in``), in features.
        copied: both sides copied (the new columns *and* the new input coordinates are copies,
            the ``sparkling`` init): Eq. 16/17, with ``c = d_in_new/d_in − 1``,
            ``α = 1/√(1+3c)`` for ``c ≤ 1`` and ``1/(1+c)`` for ``c > 1`` (½ at 2×).
            Otherwise (random, zero or one-side-copied new columns; App. B treats a zero side
            as random): Eq. 14, ``α = √(d_in/d_in_new)``.
    Returns:
        α, a float in (0, 1).
    Raises:
        InvalidValueError: ``d_in_new <= d_in`` or a non-positive width.
    """
    if not (isinstance(d_in, int) and isinstance(d_in_new, int) and 0 < d_in < d_in_new):
        raise InvalidValueError(
            f"fan_in_scale: needs 0 < d_in < d_in_new (ints), got {d_in!r}, {d_in_new!r}"
        )
    if not copied:
        return math.sqrt(d_in / d_in_new)
    c = d_in_new / d_in - 1
    return 1 / math.sqrt(1 + 3 * c) if c <= 1 else 1 / (1 + c)


@dataclass(frozen=True)
class ExpandSpec:
    """One width expansion.

    Attributes:
        hidden: factor (> 1) of d_model (heads and head_dim kept), or None.
        inner: factor (> 1) of the expert / shared-expert / dense-FFN inner width, or None.
        init: ``sparkling`` (the paper's copy-copy), ``random``, ``naive`` or ``copy``.
        state: ``asymmetric`` (the paper's), ``scaled`` or ``symmetric`` optimizer state.
        rewarm_steps: τ_w, re-warmup steps of the new entries' groups (asymmetric and
            scaled only; 0 = jump straight to ``ρ·η_e`` and decay from there).
        rewarm_ratio: ρ, the new groups' re-warmup peak over the rate at the expansion
            (paper: 1.3; 1 with ``rewarm_steps=0`` is no boost).
    """

    hidden: float | None = None
    inner: float | None = None
    init: str = "sparkling"
    state: str = "asymmetric"
    rewarm_steps: int = 0
    rewarm_ratio: float = REWARM_RATIO

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


# ------------------------------------------------------------------------------ plans
def param_plans(old: ModelConfig, new: ModelConfig) -> dict[str, ParamPlan]:
    """One :class:`ParamPlan` per parameter name of a model with config ``old``.

    Raises:
        InvalidValueError: the model has a parameter this module does not know how to grow.
    """
    if (old.n_heads, old.n_kv_heads, old.head_dim) != (new.n_heads, new.n_kv_heads, new.head_dim):
        raise InvalidValueError(
            "expand: the attention heads must stay as they are (n_heads, n_kv_heads, head_dim)"
        )
    D = Axis(old.d_model, new.d_model)
    Q = K = None  # heads and head_dim are kept (SPARKLING §3.3): q/k/v/o never grow there
    Fd = Axis(old.dense_ffn_size, new.dense_ffn_size, role="inner")
    plans: dict[str, ParamPlan] = {}

    def add(name, axes, in_dims=(), kind="matrix", per_expert=False, scale_with=None):
        plans[name] = ParamPlan(name, tuple(axes), tuple(in_dims), kind, per_expert, scale_with)

    add("embed.weight", (None, D), kind="embedding")
    if not old.tie_embeddings:
        add("lm_head.weight", (None, D), (1,))
    add("norm.weight", (D,), kind="norm")
    for i in range(old.n_layers):
        b = f"blocks.{i}"
        add(f"{b}.attn_norm.weight", (D,), kind="norm")
        add(f"{b}.ffn_norm.weight", (D,), kind="norm")
        for proj, out_axis in (("q_proj", Q), ("k_proj", K), ("v_proj", K)):
            add(f"{b}.attn.{proj}.weight", (out_axis, D), (1,))
            add(
                f"{b}.attn.{proj}.bias",
                (out_axis,),
                kind="bias",
                scale_with=f"{b}.attn.{proj}.weight",
            )
        add(f"{b}.attn.o_proj.weight", (D, Q), (1,))
        if old.qk_norm != "none":  # over head_dim or the heads' width: neither grows
            add(f"{b}.attn.q_norm.weight", (None,), kind="norm")
            add(f"{b}.attn.k_norm.weight", (None,), kind="norm")
        if not old.is_moe_layer(i):
            add(f"{b}.ffn.w_gate.weight", (Fd, D), (1,))
            add(f"{b}.ffn.w_up.weight", (Fd, D), (1,))
            add(f"{b}.ffn.w_down.weight", (D, Fd), (1,))
            continue
        ex_o, ex_n = old.moe.experts, new.moe.experts
        Fe = Axis(ex_o.ffn_hidden_size, ex_n.ffn_hidden_size, role="inner")
        m = f"{b}.ffn"
        add(f"{m}.router.weight", (None, D), (1,))
        gated = ex_o.activation in GATED_ACTIVATIONS
        Fin = Axis(2 * Fe.old, 2 * Fe.new, blocks=2, role="inner") if gated else Fe
        w_in = "w_gate_up" if gated else "w_up"
        add(f"{m}.experts.{w_in}", (None, D, Fin), (1,), per_expert=True)
        add(f"{m}.experts.w_down", (None, Fe, D), (1,), per_expert=True)
        if ex_o.bias:  # like q/k/v's biases: copied unscaled, or 0 when new (random) [I]
            for b, axis, w in (("b" + w_in[1:], Fin, w_in), ("b_down", D, "w_down")):
                add(f"{m}.experts.{b}", (None, axis), kind="bias", per_expert=True,
                    scale_with=f"{m}.experts.{w}")  # fmt: skip
        if ex_o.shared_expert_size:
            Fs = Axis(ex_o.shared_expert_size, ex_n.shared_expert_size, role="inner")
            Fs2 = Axis(2 * Fs.old, 2 * Fs.new, blocks=2, role="inner")
            add(f"{m}.shared_expert.w_gate_up", (D, Fs2), (0,))
            add(f"{m}.shared_expert.w_down", (Fs, D), (0,))
            if ex_o.shared_expert_gate:
                add(f"{m}.shared_expert.gate", (None, D), (1,))
    return plans


def model_plans(model: MoETransformer, new: ModelConfig) -> dict[str, ParamPlan]:
    """:func:`param_plans` for exactly the parameters ``model`` has.

    Raises:
        InvalidValueError: a parameter this module does not know how to grow.
    """
    plans = param_plans(model.cfg, new)
    out = {}
    for name, p in model.named_parameters():
        plan = plans.get(name)
        if plan is None or len(plan.axes) != p.dim():
            raise InvalidValueError(f"expand: cannot grow parameter {name} {tuple(p.shape)}")
        out[name] = plan
    return out


# ------------------------------------------------------------------------ calibration
def _rms(y: Tensor, per_expert: bool = False) -> Tensor:
    y = y.double()
    if per_expert:
        return y.pow(2).flatten(1).mean(1).sqrt()
    return y.pow(2).mean().sqrt()


def _ratio(ref: Tensor, now: Tensor) -> Tensor:
    return torch.where(now > 0, ref / now.clamp_min(1e-300), torch.ones_like(now))


@torch.no_grad()
def matrix_output_rms(
    model: MoETransformer,
    input_ids: Tensor,
    refs: dict[str, Tensor] | None = None,
    rescale: frozenset[str] = frozenset(),
) -> dict[str, Tensor]:
    """RMS of every matrix's output on ``input_ids`` ``[B, S]``, in one forward pass.

    Keys are parameter names (``"blocks.0.attn.q_proj.weight"``, ``"...experts.w_down"``);
    values float64 scalars, ``[E]`` per expert for expert banks (every expert applied to every
    token, so the value does not depend on the routing). ``"lm_head.weight"`` is reported
    also with tied embeddings.

    With ``refs``, each matrix named in ``rescale`` is multiplied (with its bias) by
    ``c = refs[name] / rms`` *before* the module runs, so later matrices see the rescaled
    activations; the returned dict then holds the ``c`` of those matrices (SPARKLING's
    RMS-scale consistency, fitted on this calibration batch).
    """
    out: dict[str, Tensor] = {}
    hooks = []

    def fit(key: str, y: Tensor, params: list[Tensor | None], per_expert=False) -> Tensor:
        rms = _rms(y, per_expert)
        if refs is None or key not in rescale:
            if refs is None:
                out.setdefault(key, rms)
            return torch.ones_like(rms)
        c = _ratio(refs[key], rms)
        out[key] = c
        for p in params:
            if p is not None:
                p.mul_(
                    c.reshape(-1, *([1] * (p.dim() - 1))).to(p.dtype)
                    if per_expert
                    else c.to(p.dtype)
                )
        return c

    def linear_hook(name):
        def hook(mod, args):
            x = args[0]
            key = f"{name}.weight"
            target = [mod.weight, mod.bias]
            if name == "lm_head" and model.cfg.tie_embeddings:
                target = [model.norm.weight]
            fit(key, F.linear(x, mod.weight, mod.bias), target)

        return hook

    def router_hook(name):
        def hook(mod, args):
            x = args[0].to(torch.promote_types(args[0].dtype, torch.float32))
            fit(f"{name}.weight", F.linear(x, mod.weight.to(x.dtype)), [mod.weight])

        return hook

    def moe_hook(name):
        def hook(mod, args):
            bank = mod.experts
            x = args[0].reshape(-1, args[0].shape[-1])
            b_in, b_down = bank.b_in, getattr(bank, "b_down", None)
            h = torch.einsum("td,edf->etf", x, bank.w_in)
            h = h if b_in is None else h + b_in[:, None, :]
            in_name = "w_gate_up" if bank.config.activation in GATED_ACTIVATIONS else "w_up"
            c = fit(f"{name}.experts.{in_name}", h, [bank.w_in, b_in], per_expert=True)
            a = bank.activation(h * c.reshape(-1, 1, 1).to(h.dtype))
            y = torch.einsum("etf,efd->etd", a, bank.w_down)
            y = y if b_down is None else y + b_down[:, None, :]
            fit(f"{name}.experts.w_down", y, [bank.w_down, b_down], per_expert=True)

        return hook

    def shared_hook(name):
        def hook(mod, args):
            x = args[0]
            h = x @ mod.w_gate_up
            c = fit(f"{name}.w_gate_up", h, [mod.w_gate_up])
            gate, up = (h * c.to(h.dtype)).chunk(2, dim=-1)
            fit(f"{name}.w_down", (F.silu(gate) * up) @ mod.w_down, [mod.w_down])
            if mod.gate is not None:
                fit(f"{name}.gate", F.linear(x, mod.gate), [mod.gate])

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(linear_hook(name)))
        elif isinstance(mod, Router):
            hooks.append(mod.register_forward_pre_hook(router_hook(name)))
        elif isinstance(mod, MoELayer):
            hooks.append(mod.register_forward_pre_hook(moe_hook(name)))
        elif isinstance(mod, SharedExpert):
            hooks.append(mod.register_forward_pre_hook(shared_hook(name)))
    was_training = model.training
    model.eval()
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return out


# ---------------------------------------------------------------------------- weights
def sparkling_entry_scale(plan: ParamPlan, new_shape: tuple[int, ...]) -> Tensor:
    """The factor every entry of a ``sparkling``-grown parameter gets on top of being copied,
    float64, broadcastable to ``new_shape``: :func:`fan_in_scale` (both sides copied) of each
    growing input dimension for matrices, 1 for embeddings, norms and biases (fan-out and
    gains are copied unscaled, SPARKLING §3.2.2, §3.2.4 [P]; biases [I])."""
    scale = torch.ones((), dtype=torch.float64)
    if plan.kind != "matrix":
        return scale.expand(new_shape)
    for d in plan.in_dims:
        a = plan.axes[d]
        if a is not None and a.grows:
            scale = scale * fan_in_scale(a.old, a.new, copied=True)
    return scale.expand(new_shape)


def _new_tensor(
    old: Tensor, fresh: Tensor, plan: ParamPlan, init: str, gen: torch.Generator
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The grown tensor, the scale its old entries received (old-shaped, float64) and, for the
    copy-based inits, the scale of every entry relative to its source (new-shaped, float64)."""
    ones = torch.ones(old.shape, dtype=torch.float64)
    if not plan.grows:
        return old.clone(), ones, None
    if init in ("copy", "sparkling"):
        shape = plan.new_shape(old.shape)
        if init == "copy":
            entry = (1.0 / plan.copy_divisor(shape, torch.float64)).expand(shape)
        else:
            entry = sparkling_entry_scale(plan, shape)
        new = (plan.gather_copy(old, power=0).double() * entry).to(old.dtype)
        return new, entry[plan.old_index(old.shape)].clone(), entry
    if init == "naive":
        new = fresh.detach().clone()
    else:  # random
        shape = plan.new_shape(old.shape)
        if plan.kind == "norm":
            new = torch.full(shape, float(old.mean()), dtype=old.dtype)
        else:  # matrices, embeddings and biases: N(0, rms(old)^2), per expert for banks
            rms = old.double().pow(2)
            rms = rms.flatten(1).mean(1).sqrt() if plan.per_expert else rms.mean().sqrt()
            std = rms.reshape(-1, *([1] * (old.dim() - 1))) if plan.per_expert else rms
            new = (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(old.dtype)
    new[plan.old_index(old.shape)] = old
    return new, ones, None


@dataclass
class ExpandedModel:
    """What :func:`expand_model` returns.

    Attributes:
        model: the grown model (new object; the old one is untouched).
        plans: the :class:`ParamPlan` of every parameter (old names).
        old_scales: per parameter, the factor its old entries were multiplied by (old
            shape, float64): the fan-in constant for sparkling, ``1/copies`` for copy, the
            fitted ``c`` for random, 1 for naive.
        scales: the fitted ``c`` per rescaled matrix (random only).
        copy_scales: for the copy-based inits (sparkling, copy), per grown parameter, every
            entry's factor relative to the entry it copies (new shape, float64); the
            symmetric state policy scales copied moments by it.
    """

    model: MoETransformer
    plans: dict[str, ParamPlan]
    old_scales: dict[str, Tensor]
    scales: dict[str, Tensor]
    copy_scales: dict[str, Tensor] = dataclasses.field(default_factory=dict)


def check_expansion(
    cfg: ModelConfig, spec: ExpandSpec, model: MoETransformer | None = None
) -> ModelConfig:
    """The grown config, after checking that ``spec`` can grow a model of config ``cfg``
    (and, given ``model``, every parameter it has); called before training starts, so a bad
    factor fails before anything is written.

    Raises:
        InvalidValueError: a factor leaving fractional widths; copy with a non-integer hidden
            factor; a parameter this module cannot grow (e.g. LoRA adapters).
        ModelTooLargeError: the grown model's parameters would not fit in memory.
    """
    new_cfg = expanded_config(cfg, spec.hidden, spec.inner)
    if spec.init == "copy" and spec.hidden is not None and spec.hidden != int(spec.hidden):
        raise InvalidValueError(
            f"hidden: copy init duplicates the residual stream and needs a whole factor, got {spec.hidden:g}"
        )
    if model is not None:
        model_plans(model, new_cfg)
    check_model_fits(new_cfg)
    return new_cfg


@torch.no_grad()
def expand_model(
    model: MoETransformer, spec: ExpandSpec, calib_ids: Tensor | None = None, seed: int = 0
) -> ExpandedModel:
    """Grow ``model``'s width as ``spec`` says (module docstring).

    Args:
        model: the model to grow (not modified).
        spec: factors and initialisation.
        calib_ids: ``[B, S]`` int64 token ids of the calibration batch (needed by ``random``
            only; about 8 sequences); ``sparkling`` uses analytic constants.
        seed: seeds the new entries' random draws (``random``, ``naive``; the global RNG is
            left untouched).
    Returns:
        :class:`ExpandedModel`; its model's config has ``logit_scale`` times the LM head's
        fan-in factor for a ``sparkling`` hidden expansion with tied embeddings.
    Raises:
        InvalidValueError: factors that leave fractional widths, a copy with a non-integer
            hidden factor, a random expansion without a calibration batch, or a parameter
            this module cannot grow.
    """
    if not isinstance(model, MoETransformer):
        raise InvalidTypeError(f"model: expected MoETransformer, got {type(model).__name__}")
    cfg = model.cfg
    new_cfg = check_expansion(cfg, spec)
    if spec.init == "random" and calib_ids is None:
        raise InvalidValueError("calib_ids: the random init needs a calibration batch")
    if spec.init == "sparkling" and cfg.tie_embeddings and spec.hidden is not None:
        # the tied matrix is the embedding (fan-out: copied, unscaled) and the head (fan-in):
        # the head's factor goes after the output projection (App. D.1)
        head_scale = fan_in_scale(cfg.d_model, new_cfg.d_model, copied=True)
        new_cfg = dataclasses.replace(new_cfg, logit_scale=cfg.logit_scale * head_scale)
    plans = model_plans(model, new_cfg)
    p0 = next(model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        new_model = MoETransformer(new_cfg).to(dtype=p0.dtype, device=p0.device)
    gen = torch.Generator().manual_seed(seed + 1)
    fresh = dict(new_model.named_parameters())
    old_scales: dict[str, Tensor] = {}
    copy_scales: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        new, scale, entry = _new_tensor(
            p.detach().cpu(), fresh[name].cpu(), plans[name], spec.init, gen
        )
        fresh[name].copy_(new.to(fresh[name].device))
        old_scales[name] = scale
        if entry is not None:
            copy_scales[name] = entry
    new_bufs = dict(new_model.named_buffers())
    for name, buf in model.named_buffers():
        if name in new_bufs and new_bufs[name].shape == buf.shape:
            new_bufs[name].copy_(buf)
    if cfg.tie_embeddings and spec.init == "copy" and spec.hidden is not None:
        new_model.norm.weight.div_(spec.hidden)
        old_scales["norm.weight"] = old_scales["norm.weight"] / spec.hidden
        if "norm.weight" in copy_scales:
            copy_scales["norm.weight"] = copy_scales["norm.weight"] / spec.hidden
    scales: dict[str, Tensor] = {}
    if spec.init == "random":
        ids = calib_ids.to(p0.device)
        refs = matrix_output_rms(model, ids)
        grown = {n for n, pl in plans.items() if pl.kind == "matrix" and pl.input_grows}
        if spec.hidden is not None:
            grown.add("lm_head.weight")
        scales = matrix_output_rms(new_model, ids, refs, frozenset(grown))
        for key, c in scales.items():
            target = "norm.weight" if key == "lm_head.weight" and cfg.tie_embeddings else key
            s = c.reshape(-1, *([1] * (old_scales[target].dim() - 1))) if c.dim() else c
            old_scales[target] = old_scales[target] * s
            for bias, pl in plans.items():
                if pl.scale_with == key:
                    cb = c.reshape(-1, *([1] * (old_scales[bias].dim() - 1))) if c.dim() else c
                    old_scales[bias] = old_scales[bias] * cb
    new_model.train(model.training)
    return ExpandedModel(new_model, plans, old_scales, scales, copy_scales)


# -------------------------------------------------------------------------- optimizer
_POWERS = {"exp_avg": 1, "exp_avg_sq": 2, "momentum_buffer": 1, "max_exp_avg_sq": 2}


def _local(region: Region, within: Region) -> tuple[slice, ...]:
    return tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(region, within, strict=True))


def _scale_state(state: dict[str, Any], scale: Tensor) -> dict[str, Any]:
    out = {}
    for key, v in state.items():
        if key in _POWERS and isinstance(v, Tensor):
            out[key] = v * scale.pow(_POWERS[key]).to(v.dtype)
        else:
            out[key] = v.clone() if isinstance(v, Tensor) else v
    return out


def expand_optimizer(
    opt: ShardedOptimizer,
    old_model: MoETransformer,
    expanded: ExpandedModel,
    spec: ExpandSpec,
    cfg: TrainConfig,
    step: int,
) -> ShardedOptimizer:
    """The optimizer of ``expanded.model``: ``opt``'s shards and state carried over to the
    grown parameters and new shards for the new entries (module docstring: ``state``).

    With ``state`` ``asymmetric`` or ``scaled`` the new entries' groups carry the re-warmup
    of SPARKLING Eq. 28 (keys ``rewarm_from`` = ``step``, ``rewarm_steps`` τ_w,
    ``rewarm_ratio`` ρ, ``rewarm_lr`` η_e = the base schedule's rate at ``step``,
    ``rewarm_min_lr`` η_min = ``cfg.lr · cfg.min_lr_ratio``, ``rewarm_total_steps`` T =
    ``cfg.steps``), which :meth:`ShardedOptimizer.set_lr` follows.

    Args:
        opt: the old model's optimizer (not modified).
        old_model: the model ``opt`` optimizes.
        expanded: :func:`expand_model`'s result for ``old_model``.
        spec: the expansion (``state``, ``rewarm_steps``, ``rewarm_ratio``).
        cfg: betas/eps/lr and the schedule (warmup, steps, min_lr_ratio) of the run.
        step: the optimizer step the expansion happens before (re-warmup starts there).
    """
    old_params = dict(old_model.named_parameters())
    new_params = dict(expanded.model.named_parameters())
    plans = expanded.plans
    layout: list[dict[str, Any]] = []
    pending: list[tuple[int, int, dict[str, Any]]] = []  # (group, shard index, state)
    old_full: dict[str, dict[str, Tensor]] = {}
    old_step: dict[str, Any] = {}
    kind_of: dict[str, tuple[str, float]] = {}
    for gi, g in enumerate(opt.layout):
        ng = dict(g, shards=[])
        for (name, region), tensor in zip(g["shards"], opt.shards[gi], strict=True):
            p_old = old_params[name]
            plan = plans[name]
            kind_of.setdefault(name, (g["optimizer"], g["weight_decay"]))
            reg = full_region(p_old.shape) if region is None else tuple(map(tuple, region))
            st = opt.state_of(tensor)
            if st:
                old_step[name] = st.get("step", old_step.get(name))
                full = old_full.setdefault(name, {})
                for key, v in st.items():
                    if key in _POWERS:
                        full.setdefault(key, torch.zeros(p_old.shape, dtype=v.dtype))
                        full[key][region_slices(reg)] = v.cpu()
            scale = expanded.old_scales[name]
            for old_sub, new_reg in plan.map_region(reg):
                sub_state = {}
                if st:
                    local = _local(old_sub, reg)
                    sub_state = {
                        k: v[local] if isinstance(v, Tensor) and v.dim() else v
                        for k, v in st.items()
                    }
                    if spec.state == "asymmetric":  # kept as it is (Eq. 24)
                        sub_state = _scale_state(sub_state, torch.ones((), dtype=torch.float64))
                    else:
                        sub_state = _scale_state(sub_state, scale[region_slices(old_sub)])
                whole = new_reg == full_region(new_params[name].shape)
                ng["shards"].append([name, None if whole else [list(r) for r in new_reg]])
                if sub_state:
                    pending.append((len(layout), len(ng["shards"]) - 1, sub_state))
        layout.append(ng)
    # new entries: new groups keyed by (optimizer, weight decay)
    new_groups: dict[tuple[str, float], dict[str, Any]] = {}
    asym = spec.state in ("asymmetric", "scaled")
    rewarm: dict[str, Any] = {"rewarm_from": None, "rewarm_steps": 0}
    if asym:
        eta_e = scheduled_lr(cfg, step)
        rewarm = {
            "rewarm_from": step,
            "rewarm_steps": spec.rewarm_steps,
            "rewarm_ratio": float(spec.rewarm_ratio),
            "rewarm_lr": eta_e,
            "rewarm_min_lr": cfg.lr * cfg.min_lr_ratio,
            "rewarm_total_steps": cfg.steps,
        }
    for name, plan in plans.items():
        if not plan.grows:
            continue
        kind, wd = kind_of[name]
        key = (kind, wd)
        if key not in new_groups:
            new_groups[key] = {"optimizer": kind, "weight_decay": wd, **rewarm, "shards": []}
            layout.append(new_groups[key])
        gi = layout.index(new_groups[key])
        shape = tuple(new_params[name].shape)
        copied = None
        if not asym and name in old_full:
            entry = expanded.copy_scales.get(name)
            copied = {
                k: (
                    (plan.gather_copy(v, power=0).double() * entry.pow(_POWERS[k])).to(v.dtype)
                    if entry is not None
                    else torch.zeros(shape, dtype=v.dtype)
                )
                for k, v in old_full[name].items()
            }
        for reg in plan.new_regions(shape):
            new_groups[key]["shards"].append([name, [list(r) for r in reg]])
            if copied is not None:
                st = {k: v[region_slices(reg)].clone() for k, v in copied.items()}
                if old_step.get(name) is not None:
                    st["step"] = old_step[name].clone()
                pending.append((gi, len(new_groups[key]["shards"]) - 1, st))
    new_opt = ShardedOptimizer(expanded.model, cfg, layout)
    for gi, si, st in pending:
        tensor = new_opt.shards[gi][si]
        dev = tensor.device
        new_opt.opt_of(gi).state[tensor] = {
            k: (v.to(dev) if isinstance(v, Tensor) and k in _POWERS else v) for k, v in st.items()
        }
    return new_opt


@dataclass
class Expansion:
    """A grown model with its optimizer (:func:`expand_live`)."""

    model: MoETransformer
    optimizer: ShardedOptimizer
    scales: dict[str, Tensor]
    plans: dict[str, ParamPlan]
    spec: ExpandSpec


def expand_live(
    model: MoETransformer,
    optimizer: ShardedOptimizer,
    spec: ExpandSpec,
    cfg: TrainConfig,
    *,
    step: int,
    calib_ids: Tensor | None,
    seed: int,
) -> Expansion:
    """Grow a model in training and its optimizer before optimizer step ``step``.

    Raises:
        InvalidValueError: see :func:`expand_model`.
    """
    grown = expand_model(model, spec, calib_ids, seed)
    new_opt = expand_optimizer(optimizer, model, grown, spec, cfg, step)
    return Expansion(grown.model, new_opt, grown.scales, grown.plans, spec)


def expansion_record(step: int, cfg: ModelConfig, spec: ExpandSpec) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of an expansion (``split: "expand"``): new widths and how."""
    inner = cfg.moe.experts.ffn_hidden_size if cfg.moe is not None else cfg.dense_ffn_size
    return {
        "step": step,
        "split": "expand",
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "inner": inner,
        "hidden_factor": spec.hidden,
        "inner_factor": spec.inner,
        "init": spec.init,
        "state": spec.state,
        "rewarm_steps": spec.rewarm_steps,
        "rewarm_ratio": spec.rewarm_ratio,
        "logit_scale": cfg.logit_scale,
    }


CALIBRATION_SEQUENCES = 8


def expand_in_training(
    model: MoETransformer,
    optimizer: ShardedOptimizer,
    spec: ExpandSpec,
    cfg: TrainConfig,
    stream: TokenStream,
    step: int,
) -> Expansion:
    """:func:`expand_live` as the training loop and ``moelab expand`` do it: the calibration
    batch of the ``random`` init (8 training sequences) and the new entries' random draws come
    from their own generators seeded by ``(cfg.seed, step)``, so the training batches and RNG
    are untouched and an in-loop expansion, a resumed one and an offline one give the same
    model. The other inits need no calibration batch (none is drawn)."""
    seed = cfg.seed * 7919 + step
    gen = torch.Generator().manual_seed(seed)
    calib = None
    if spec.init == "random":
        calib = sample_batch(stream, CALIBRATION_SEQUENCES, cfg.seq_len, gen).input_ids
    return expand_live(model, optimizer, spec, cfg, step=step, calib_ids=calib, seed=seed)


# ---------------------------------------------------------------------------- metrics
@torch.no_grad()
def counterpart_cosine(model: MoETransformer, old_cfg: ModelConfig, role: str) -> float:
    """Mean cosine similarity between every new unit and the old unit it copies (or, for
    random inits, its counterpart ``j mod old``) after a ``role`` expansion of a model with
    config ``old_cfg`` into ``model``.

    A unit's vector is its weights in every matrix that touches it (norm gains and biases
    left out): for ``role="hidden"`` a residual channel (its embedding column and its
    column/row in every matrix), for ``role="inner"`` one expert's (or dense FFN's) hidden
    unit (gate and up columns, down row). 1.0 means the copies never
    diverged (gradient symmetry); near 0 means independent features.
    """
    plans = param_plans(old_cfg, model.cfg)
    families: dict[str, list[Tensor]] = {}
    axes: dict[str, Axis] = {}
    for name, p in model.named_parameters():
        plan = plans[name]
        if plan.kind in ("norm", "bias"):  # gains ~1 would dominate every unit's vector
            continue
        dims = [d for d, a in enumerate(plan.axes) if a is not None and a.role == role and a.grows]
        if not dims:
            continue
        d = dims[0]
        a = plan.axes[d]
        n_new_b = a.new // a.blocks
        t = p.detach().double().movedim(d, -1)
        t = t.reshape(*t.shape[:-1], a.blocks, n_new_b).movedim(-1, 0)  # [n, ..., blocks]
        unit_axis = Axis(a.old // a.blocks, n_new_b, role=role)
        parts = name.split(".")
        parts = parts[:-1] if parts[-1] in ("weight", "bias") else parts
        fam = ".".join(parts[:-1]) if role != "hidden" else "hidden"
        if role != "hidden" and plan.per_expert:  # [n, E, ...] -> [E, n, rest]
            t = t.reshape(t.shape[0], t.shape[1], -1).transpose(0, 1)
        else:
            t = t.reshape(1, t.shape[0], -1)
        fam += f"|{unit_axis.old}"
        families.setdefault(fam, []).append(t)
        axes[fam] = unit_axis
    sims = []
    for fam, parts in families.items():
        v = torch.cat(parts, dim=-1)  # [G, n_new, dim]
        a = axes[fam]
        src = a.source()[a.old :]
        new = torch.arange(a.old, a.new)
        sims.append(F.cosine_similarity(v[:, new], v[:, src], dim=-1).mean())
    if not sims:
        raise InvalidValueError(f"role: the model has no grown {role} axis relative to old_cfg")
    return float(torch.stack(sims).mean())


__all__ = [
    "ExpandSpec",
    "ExpandedModel",
    "Expansion",
    "counterpart_cosine",
    "default_rewarm_steps",
    "expand_in_training",
    "expand_live",
    "expand_model",
    "expand_optimizer",
    "expanded_config",
    "fan_in_scale",
    "matrix_output_rms",
    "param_plans",
    "parse_expand",
    "parse_factor",
    "sparkling_entry_scale",
]
