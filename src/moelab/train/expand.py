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

The code is split by concern: :mod:`~moelab.train.expand_spec` (specs, factor parsing, the
grown config), :mod:`~moelab.train.expand_plans` (per-parameter plans),
:mod:`~moelab.train.expand_init` (init maths, the grown model),
:mod:`~moelab.train.expand_calibration` (the ``random`` ablation's fitted scale),
:mod:`~moelab.train.expand_state` (optimizer-state surgery); this module runs an expansion
and re-exports their public names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from moelab.data import TokenStream, sample_batch
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer
from moelab.train.config import TrainConfig
from moelab.train.expand_axes import Axis, ParamPlan
from moelab.train.expand_calibration import matrix_output_rms
from moelab.train.expand_init import (
    ExpandedModel,
    check_expansion,
    expand_model,
    fan_in_scale,
    sparkling_entry_scale,
)
from moelab.train.expand_plans import model_plans, param_plans
from moelab.train.expand_spec import (
    INITS,
    PAPER_REWARM_STEPS,
    REWARM_RATIO,
    REWARM_TAILS,
    STATES,
    ExpandSpec,
    default_rewarm_steps,
    expanded_config,
    parse_expand,
    parse_factor,
)
from moelab.train.expand_state import expand_optimizer
from moelab.train.optim import ShardedOptimizer


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
        "rewarm_tail": spec.rewarm_tail,
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
    "INITS",
    "PAPER_REWARM_STEPS",
    "REWARM_RATIO",
    "REWARM_TAILS",
    "STATES",
    "ExpandSpec",
    "ExpandedModel",
    "Expansion",
    "check_expansion",
    "counterpart_cosine",
    "default_rewarm_steps",
    "expand_in_training",
    "expand_live",
    "expand_model",
    "expand_optimizer",
    "expanded_config",
    "expansion_record",
    "fan_in_scale",
    "matrix_output_rms",
    "model_plans",
    "param_plans",
    "parse_expand",
    "parse_factor",
    "sparkling_entry_scale",
]
