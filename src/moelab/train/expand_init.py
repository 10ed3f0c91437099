"""SPARKLING expansion init maths: the analytic fan-in constant (Eq. 14/16), the grown
value of every parameter for each ``init`` and the grown model (rules in
:mod:`moelab.train.expand`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models import ModelConfig, MoETransformer
from moelab.models.memory import check_model_fits
from moelab.train.expand_axes import ParamPlan
from moelab.train.expand_calibration import matrix_output_rms
from moelab.train.expand_plans import model_plans
from moelab.train.expand_spec import ExpandSpec, expanded_config


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
