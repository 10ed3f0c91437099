"""Training, early stopping and test-time BatchNorm refit of the EEG-MoCE networks.

As the authors' ``MultimodalTrainer`` runs (``nets/trainer.py``, ``nets/callbacks.py``) [C]:

* ``torch.optim.Adam`` (coupled L2), lr 1e-3 from step 0 for every group (the curvature
  warm-up callback returns early, so it never runs); weight decay 1e-3 on every parameter but
  the curvatures (the ``Trainer`` default, since ``weight_decay`` is not passed), 0 on them;
* after ``backward``, each manifold's ``k`` gradient is clipped to norm ``curvature_clip``;
  after the step ``k`` is clamped to ``≥ k_min``;
* cross-entropy, batches of 50 shuffled each epoch, validation loss each epoch, stop when
  it has not improved for ``patience`` epochs but never before ``min_epochs``; the
  best-validation-loss state is restored at the end.

Not as the code [I]: no ``RiemannianAdam`` (the code configures one but creates no manifold
parameter, so it is moot); the test-time refit is of the encoders' BatchNorm statistics on the
whole test split (:func:`refit_batchnorm`), where the code refits its Lorentz domain BN per test
subject.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import TrainingDivergedError
from moelab.methods.multimodal.config import EEGMoCEConfig


@dataclass
class Fit:
    """A trained network: ``model`` (best-validation state, eval mode), ``epochs`` run,
    ``best_epoch`` (1-based) and ``best_val_loss``."""

    model: nn.Module
    epochs: int
    best_epoch: int
    best_val_loss: float


def _batch(inputs: dict[str, Tensor], idx: Tensor) -> dict[str, Tensor]:
    return {m: x[idx] for m, x in inputs.items()}


def curvature_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable Lorentz ``k`` of every expert (parameters named ``...manifold.k``)."""
    return [p for n, p in model.named_parameters() if n.endswith("manifold.k") and p.requires_grad]


def make_optimizer(model: nn.Module, config: EEGMoCEConfig) -> torch.optim.Adam:
    """Adam (coupled L2) with two groups: every trainable parameter but the curvatures with
    ``weight_decay``, then the curvatures (if any) with none; one learning rate."""
    curv = curvature_parameters(model)
    curv_ids = {id(p) for p in curv}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in curv_ids]
    groups = [{"params": rest, "weight_decay": config.weight_decay}]
    if curv:
        groups.append({"params": curv, "weight_decay": 0.0})
    return torch.optim.Adam(groups, lr=config.lr)


def fit(
    model: nn.Module,
    train: tuple[dict[str, Tensor], Tensor],
    val: tuple[dict[str, Tensor], Tensor],
    config: EEGMoCEConfig,
    seed: int,
) -> Fit:
    """Train ``model`` (``forward(inputs) → (logits, attn)``) on ``train`` with early stopping
    on ``val`` (both ``(inputs, labels)``, float64 inputs, int64 labels).

    Raises:
        TrainingDivergedError: a training loss is NaN or infinite (names the epoch).
    """
    curv = curvature_parameters(model)
    opt = make_optimizer(model, config)
    gen = torch.Generator().manual_seed(seed)
    x_tr, y_tr = train
    x_va, y_va = val
    n = len(y_tr)
    best, best_state, best_epoch, epoch = float("inf"), None, 0, 0
    for epoch in range(1, config.max_epochs + 1):
        model.train()
        for idx in torch.randperm(n, generator=gen).split(config.batch_size):
            logits, _ = model(_batch(x_tr, idx))
            loss = F.cross_entropy(logits, y_tr[idx])
            if not torch.isfinite(loss):
                raise TrainingDivergedError(
                    f"training loss is {loss.item()} in epoch {epoch}; lower lr"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for k in curv:
                nn.utils.clip_grad_norm_([k], config.curvature_clip)
            opt.step()
            with torch.no_grad():
                for k in curv:
                    k.clamp_(min=config.k_min)
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(model(x_va)[0], y_va).item()
        if val_loss < best:
            best, best_epoch = val_loss, epoch
            best_state = copy.deepcopy(model.state_dict())
        if epoch >= config.min_epochs and epoch - best_epoch >= config.patience:
            break
    model.load_state_dict(best_state)
    model.eval()
    return Fit(model, epoch, best_epoch, best)


def refit_batchnorm(model: nn.Module, inputs: dict[str, Tensor]) -> None:
    """Replace every BatchNorm's running statistics by those of ``inputs`` (one pass, all
    samples at once; dropout off); the model is left in eval mode."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in norms]
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average: one batch gives exactly its statistics
        m.train()
    with torch.no_grad():
        model(inputs)
    for m, momentum in zip(norms, saved, strict=True):
        m.momentum = momentum
    model.eval()


def predict(model: nn.Module, inputs: dict[str, Tensor]) -> tuple[np.ndarray, Tensor | None]:
    """Class predictions ``[N]`` and the attention ``[L, N, H, M, M]`` (or None)."""
    model.eval()
    with torch.no_grad():
        logits, attn = model(inputs)
    return logits.argmax(-1).numpy(), attn
