"""SPARKLING optimizer-state surgery: carry a :class:`~moelab.train.optim.ShardedOptimizer`'s
shards and state over to the grown parameters and give the new entries their own groups
(``state`` policies and the re-warmup in :mod:`moelab.train.expand`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moelab.models import MoETransformer
from moelab.train.config import TrainConfig
from moelab.train.expand_axes import Region, full_region
from moelab.train.expand_init import ExpandedModel
from moelab.train.expand_spec import ExpandSpec
from moelab.train.optim import ShardedOptimizer, region_slices
from moelab.train.schedule import scheduled_lr

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
            "rewarm_tail": spec.rewarm_tail,
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
