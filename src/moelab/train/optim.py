"""The training loop's optimizer: AdamW or Muon over parameter *shards* with per-group re-warmup.

A shard is a rectangular region of one model parameter. Before any width expansion every
shard is a whole parameter and the optimizer is plain ``torch.optim.AdamW`` (decay on
matrices, none on norms/biases; torch's fused kernel whenever every shard is a whole
contiguous parameter, see :func:`_fusable`) — or, with ``optimizer="muon"``,
``torch.optim.Muon`` for the 2-D hidden matrices and AdamW for the rest. After a width expansion
(:mod:`moelab.train.expand`) a parameter is covered by several shards: the region its old
entries occupy and the regions of the new entries. Each shard is a separate tensor for
``torch.optim`` — a *view* sharing the model parameter's storage, so the optimizer writes
straight into the model — and therefore has its own state (Adam moments and bias-correction
step counter, Muon momentum) and sits in its own parameter group with its own learning rate.
That is how SPARKLING's asymmetric state reset and re-warmup (arXiv 2602.02472) are realised
without changing the model's modules ("separate tensors per slice" is the spec's design
[I], see ``shared/research/methods-group1.md`` §(d)).

The layout (a list of group dicts) is saved with the optimizer state, so a checkpoint written
after an expansion rebuilds the same shards and resumes exactly.

Choices [I]:

- Muon (``torch.optim.Muon``, torch >= 2.9) takes every 2-D parameter except the token
  embedding and the LM head (Keller Jordan's recipe), with ``adjust_lr_fn="match_rms_adamw"``
  so one ``lr`` serves both optimizers; momentum 0.95, Nesterov. 3-D expert banks and 1-D
  parameters stay on AdamW (``torch.optim.Muon`` accepts 2-D tensors only). After an
  expansion each 2-D shard is orthogonalised on its own.
- Re-warmup of a group created by an expansion at step ``t_e`` (key ``rewarm_tail``):
  ``"base"``, a short boost: the base rate times a factor rising linearly from 1 to ``ρ``
  over ``rewarm_steps`` and falling back to 1 over as many, then the base schedule
  (:func:`moelab.train.schedule.rewarm_boost`); ``"own"`` (and layouts without the key):
  SPARKLING's asymmetric re-warmup as read from Eq. 28 (:func:`moelab.train.schedule.
  rewarm_lr_at`): from the rate at ``t_e`` linearly to ``ρ`` times it over
  ``rewarm_steps``, then its own cosine to the base minimum. Layouts saved before that rule (no ``rewarm_ratio`` key in the group) keep the
  older ramp ``lr(t) · min(1, (t − t_e + 1) / W_r)`` (:func:`rewarm_factor`), so their runs
  resume as they were.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moelab.core.growth import frozen_parameter_names
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.schedule import rewarm_boost, rewarm_lr_at

OPTIMIZERS = ("adamw", "muon")
LAYOUT_VERSION = 1
Region = tuple[tuple[int, int], ...]


def rewarm_factor(step: int, group: dict[str, Any]) -> float:
    """The older (pre-paper) learning-rate multiplier of a layout group at optimizer step
    ``step`` (0-based), kept for layouts saved without ``rewarm_ratio``.

    ``min(1, (step − rewarm_from + 1) / rewarm_steps)`` for a group created by an expansion at
    step ``rewarm_from``; 1 for groups without re-warmup (``rewarm_from`` None or
    ``rewarm_steps`` 0) and for steps before ``rewarm_from``.
    """
    start, n = group.get("rewarm_from"), int(group.get("rewarm_steps") or 0)
    if start is None or n <= 0 or step < start:
        return 1.0
    return min(1.0, (step - start + 1) / n)


def group_lr(step: int, lr: float, group: dict[str, Any]) -> float:
    """The learning rate of a layout group at optimizer step ``step`` when the base schedule
    gives ``lr``: ``lr`` for groups without re-warmup (``rewarm_from`` None) and before
    ``rewarm_from``; SPARKLING's re-warmup (:func:`moelab.train.schedule.rewarm_lr_at`, from
    the group's ``rewarm_*`` keys: ``rewarm_tail`` ``"base"`` a short boost on top of ``lr``,
    :func:`moelab.train.schedule.rewarm_boost`; ``"own"`` or absent, the group's own cosine)
    for groups an expansion created; the older ramp
    (:func:`rewarm_factor`) for groups saved without ``rewarm_ratio``."""
    start = group.get("rewarm_from")
    if start is None or step < start:
        return lr
    if "rewarm_ratio" not in group:
        return lr * rewarm_factor(step, group)
    if group.get("rewarm_tail") == "base":
        return lr * rewarm_boost(
            step,
            start=int(start),
            rewarm_steps=int(group.get("rewarm_steps") or 0),
            ratio=float(group["rewarm_ratio"]),
        )
    return rewarm_lr_at(
        step,
        start=int(start),
        rewarm_steps=int(group.get("rewarm_steps") or 0),
        total_steps=int(group["rewarm_total_steps"]),
        lr_start=float(group["rewarm_lr"]),
        ratio=float(group["rewarm_ratio"]),
        min_lr=float(group["rewarm_min_lr"]),
    )


def region_slices(region: Region | None) -> tuple[slice, ...]:
    """``((a0, b0), (a1, b1), ...)`` → ``(slice(a0, b0), slice(a1, b1), ...)``; None → ``()``."""
    return () if region is None else tuple(slice(a, b) for a, b in region)


def muon_eligible(name: str, p: Tensor) -> bool:
    """2-D parameters other than the token embedding and the LM head."""
    return p.dim() == 2 and name not in ("embed.weight", "lm_head.weight")


def _frozen_error(name: str) -> ConfigError:
    return ConfigError(
        f"optimizer: parameter {name!r} is frozen (requires_grad=False, or a frozen expert "
        "or old adapter expert); it must not be given to an optimizer, whose weight decay "
        "would still move it"
    )


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter with ``requires_grad``, what an optimizer may
    take.

    Raises:
        ConfigError: a permanently frozen parameter (frozen expert segment, old MoE-LoRA
            expert: :func:`moelab.core.growth.frozen_parameter_names`) has ``requires_grad``
            set again.
    """
    pinned = frozen_parameter_names(model)
    out = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for n, _ in out:
        if n in pinned:
            raise _frozen_error(n)
    return out


def default_layout(model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """One shard per parameter of :func:`trainable_parameters`: AdamW decay (>= 2-D) /
    no-decay groups, plus a Muon group."""
    groups = {
        "muon": {"optimizer": "muon", "weight_decay": cfg.weight_decay, "shards": []},
        "decay": {"optimizer": "adamw", "weight_decay": cfg.weight_decay, "shards": []},
        "no_decay": {"optimizer": "adamw", "weight_decay": 0.0, "shards": []},
    }
    for name, p in trainable_parameters(model):
        if cfg.optimizer == "muon" and muon_eligible(name, p):
            key = "muon"
        else:
            key = "decay" if p.dim() >= 2 else "no_decay"
        groups[key]["shards"].append([name, None])
    order = ("decay", "no_decay", "muon")
    return [
        {**groups[k], "rewarm_from": None, "rewarm_steps": 0} for k in order if groups[k]["shards"]
    ]


def _fusable(tensors: list[Tensor]) -> bool | None:
    """True when torch's fused AdamW kernel may take every tensor: whole, contiguous,
    floating-point parameters on CPU or CUDA. It makes one pass per parameter instead of a
    dozen elementwise ops (the `make run` model's 7.6M parameters: 17 ms per step with the
    default loop on 2 CPU cores, 6 ms fused). Shards of an expanded parameter are views whose
    gradients are strided slices, which the fused CPU kernel (torch 2.13) reads as if they
    were contiguous; they keep torch's default (None)."""
    ok = bool(tensors) and all(
        isinstance(t, nn.Parameter)
        and t.is_contiguous()
        and t.is_floating_point()
        and t.device.type in ("cpu", "cuda")
        for t in tensors
    )
    return True if ok else None


class ShardedOptimizer:
    """AdamW (+ Muon) over the shards of ``layout``; the loop's one optimizer object.

    Use as a ``torch.optim`` optimizer: ``set_lr(step, lr)``, ``step()`` (copies each
    parameter's gradient into its shards first), ``zero_grad()``, ``state_dict()`` /
    ``load_state_dict()``. ``param_groups`` lists the torch groups in layout order.

    Args:
        model: the model whose parameters the layout names.
        cfg: betas, eps (AdamW) and the base lr.
        layout: group dicts ``{"optimizer": "adamw"|"muon", "weight_decay", "rewarm_from",
            "rewarm_steps", "shards": [[param name, region or None], ...]}``; a region is
            ``[[start, stop], ...]`` per dimension of the parameter.
    Raises:
        ConfigError: a layout naming an unknown or a frozen parameter (see
            :func:`trainable_parameters`), a region outside it, an unknown optimizer, or
            Muon where ``torch.optim.Muon`` is missing or the shard is not 2-D.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, layout: list[dict[str, Any]]) -> None:
        params = dict(model.named_parameters())
        trainable = {n for n, _ in trainable_parameters(model)}
        self.layout = [dict(g, shards=[list(s) for s in g["shards"]]) for g in layout]
        self._views: list[tuple[nn.Parameter, Tensor, tuple[slice, ...]]] = []
        self.shards: list[list[Tensor]] = []
        adam_groups, muon_groups = [], []
        for g in self.layout:
            kind = g.get("optimizer")
            if kind not in OPTIMIZERS:
                raise ConfigError(f"optimizer layout: unknown optimizer {kind!r}")
            tensors = []
            for name, region in g["shards"]:
                if name not in params:
                    raise ConfigError(f"optimizer layout: the model has no parameter {name!r}")
                if name not in trainable:
                    raise _frozen_error(name)
                p = params[name]
                tensors.append(self._shard(name, p, region))
            self.shards.append(tensors)
            hyper = {"params": tensors, "weight_decay": float(g["weight_decay"]), "lr": cfg.lr}
            if kind == "muon":
                for t in tensors:
                    if t.dim() != 2:
                        raise ConfigError(f"optimizer layout: Muon shard of shape {tuple(t.shape)}")
                muon_groups.append(hyper)
            else:
                adam_groups.append(hyper)
        self._adam = (
            torch.optim.AdamW(
                adam_groups,
                lr=cfg.lr,
                betas=(cfg.beta1, cfg.beta2),
                eps=cfg.eps,
                fused=_fusable([t for g in adam_groups for t in g["params"]]),
            )
            if adam_groups
            else None
        )
        self._muon = None
        if muon_groups:
            if not hasattr(torch.optim, "Muon"):
                raise ConfigError("optimizer: muon needs torch.optim.Muon (torch >= 2.9)")
            self._muon = torch.optim.Muon(
                muon_groups, lr=cfg.lr, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"
            )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The torch group of each layout group, in layout order (looked up on every call:
        ``load_state_dict`` replaces the torch optimizers' group dicts)."""
        it_a = iter(self._adam.param_groups if self._adam else [])
        it_m = iter(self._muon.param_groups if self._muon else [])
        return [next(it_m if g["optimizer"] == "muon" else it_a) for g in self.layout]

    def _shard(self, name: str, p: nn.Parameter, region) -> Tensor:
        if region is None:
            return p
        if len(region) != p.dim() or any(
            not (0 <= a < b <= n) for (a, b), n in zip(region, p.shape, strict=True)
        ):
            raise ConfigError(
                f"optimizer layout: region {region} is outside {name} {tuple(p.shape)}"
            )
        sl = region_slices(tuple(tuple(r) for r in region))
        view = p.detach()[sl]
        self._views.append((p, view, sl))
        return view

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self._adam, self._muon) if o is not None]

    def state_of(self, tensor: Tensor) -> dict[str, Tensor]:
        """The torch state of one shard tensor (empty before its first step)."""
        for opt in self.optimizers:
            if tensor in opt.state:
                return opt.state[tensor]
        return {}

    def opt_of(self, group_idx: int) -> torch.optim.Optimizer:
        """The torch optimizer that owns layout group ``group_idx``."""
        return self._muon if self.layout[group_idx]["optimizer"] == "muon" else self._adam

    def set_lr(self, step: int, lr: float) -> None:
        """Set every group's learning rate: the scheduled ``lr``, or a re-warmed group's own
        rate (:func:`group_lr`)."""
        for g, tg in zip(self.layout, self.param_groups, strict=True):
            tg["lr"] = group_lr(step, lr, g)

    def step(self) -> None:
        for p, view, sl in self._views:
            view.grad = None if p.grad is None else p.grad[sl]
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        for p, view, _ in self._views:
            p.grad = None
            view.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "layout_version": LAYOUT_VERSION,
            "layout": self.layout,
            "optimizers": [o.state_dict() for o in self.optimizers],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (or a bare ``torch.optim.AdamW`` state dict of a
        checkpoint written before shards existed)."""
        if "optimizers" not in sd:
            if self._muon is not None or self._adam is None:
                raise ConfigError("optimizer: the checkpoint holds a plain AdamW state")
            self._adam.load_state_dict(sd)
        else:
            if len(sd["optimizers"]) != len(self.optimizers):
                raise ConfigError("optimizer: the checkpoint's optimizers do not match the layout")
            for opt, osd in zip(self.optimizers, sd["optimizers"], strict=True):
                opt.load_state_dict(osd)
        if self._adam is not None:  # torch restores the saved groups' `fused`, which
            for g in self._adam.param_groups:  # older checkpoints lack: re-derive it
                g["fused"] = self._adam.defaults["fused"]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, state: dict[str, Any] | None = None
) -> ShardedOptimizer:
    """The loop's optimizer for ``model``: the default layout, or the one saved in ``state``
    (a :meth:`ShardedOptimizer.state_dict`), whose state is then loaded.

    Raises:
        ConfigError: see :class:`ShardedOptimizer`.
    """
    layout = state.get("layout") if isinstance(state, dict) else None
    opt = ShardedOptimizer(model, cfg, layout or default_layout(model, cfg))
    if state is not None:
        opt.load_state_dict(state)
    return opt


class PlainAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` on whole parameters (decay on matrices only) with the loop's
    ``set_lr``: what expert-parallel / FSDP2 training uses, since ``torch.distributed``'s
    sharded state dicts need a real ``torch.optim`` optimizer over the (DTensor) parameters.
    No re-warmup groups, no Muon and no fused kernel there."""

    def __init__(self, model: nn.Module, cfg: TrainConfig) -> None:
        params = [p for _, p in trainable_parameters(model)]
        super().__init__(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        )  # fmt: skip

    def set_lr(self, step: int, lr: float) -> None:
        for g in self.param_groups:
            g["lr"] = lr
