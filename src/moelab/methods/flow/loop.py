"""The training loop MoLF's two stages share (the authors' ``unified_train_epoch``).

AdamW with decoupled weight decay; the router gets its own learning rate (the authors' param
group ``velocity_predictor.gating``, 1e-5 against 5e-5); the learning rate rises linearly over
the first ``warmup_fraction`` of the steps and decays linearly to 0 (transformers'
``get_linear_schedule_with_warmup``); gradients are clipped to global norm ``grad_clip``.
A non-finite loss stops training (the authors skip such batches; here it is an error).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from moelab.errors import TrainingDivergedError
from moelab.methods.flow.config import FlowConfig


def linear_warmup_decay(step: int, steps: int, warmup: int) -> float:
    """Learning-rate factor of optimizer step ``step`` (0-based): ``(step+1)/warmup`` during
    warm-up, then ``(steps − step)/(steps − warmup)`` down to ``1/(steps − warmup)``."""
    if step < warmup:
        return (step + 1) / warmup
    return max(steps - step, 0) / max(steps - warmup, 1)


def train_steps(
    model: nn.Module,
    loss_fn: Callable[[int], Tensor],
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    warmup_fraction: float = 0.05,
    grad_clip: float = 1.0,
    router_lr: float | None = None,
) -> list[float]:
    """Run ``steps`` optimizer steps of ``loss_fn(step)`` on ``model``'s trainable parameters.

    Args:
        router_lr: learning rate of the parameters whose name ends in ``router.weight``
            (None: ``lr``).
    Returns:
        The loss of every step.
    Raises:
        TrainingDivergedError: a loss is NaN or infinite (names the step).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    router = [p for n, p in params if n.endswith("router.weight")]
    rest = [p for n, p in params if not n.endswith("router.weight")]
    groups = [{"params": rest, "lr": lr}]
    if router:
        groups.append({"params": router, "lr": lr if router_lr is None else router_lr})
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, foreach=True)
    warmup = max(1, int(warmup_fraction * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_warmup_decay(s, steps, warmup))
    model.train()
    losses = []
    for step in range(steps):
        loss = loss_fn(step)
        if not torch.isfinite(loss):
            raise TrainingDivergedError(
                f"training loss is {loss.item()} at step {step}; lower lr or raise grad_clip"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def train_flow_steps(
    model: nn.Module, loss_fn: Callable[[int], Tensor], config: FlowConfig
) -> list[float]:
    """:func:`train_steps` with the flow stage's settings of ``config`` (steps, learning
    rates, decay, warm-up, clipping)."""
    return train_steps(
        model,
        loss_fn,
        steps=config.flow_steps,
        lr=config.lr,
        router_lr=config.router_lr,
        weight_decay=config.weight_decay,
        warmup_fraction=config.warmup_fraction,
        grad_clip=config.grad_clip,
    )
