"""Training and prediction of one forecaster arm.

Adam(W) on the MSE of the scaled horizon plus the MoE balance losses, mini-batches drawn
without replacement each epoch from a generator seeded by the run's seed; after every epoch
the validation MSE is measured and the best epoch's weights are kept (PatchTST's early
stopping, without stopping) [I]. Everything runs on the CPU in float32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moelab.data.timeseries import WindowSet
from moelab.errors import TrainingDivergedError
from moelab.methods.forecasting.config import ForecastConfig
from moelab.methods.forecasting.model import PatchForecaster


@dataclass
class Prediction:
    """Attributes:
    prediction: ``[N, H]`` float32 scaled forecasts.
    experts: ``{"b{block}/{tmoe|smoe}": [N, k]}`` int64 experts of each window.
    """

    prediction: np.ndarray
    experts: dict[str, np.ndarray]


def _text(text: Tensor | None, ids: np.ndarray) -> Tensor | None:
    return None if text is None else text[torch.from_numpy(ids)]


@torch.no_grad()
def predict(
    model: PatchForecaster, windows: WindowSet, text: Tensor | None, batch_size: int = 256
) -> Prediction:
    """Forecasts of every window (eval mode); ``text [n_texts, C]`` the text vectors that
    ``windows.text_id`` indexes (None for text-free arms)."""
    model.eval()
    preds, experts = [], {}
    for i in range(0, len(windows), batch_size):
        part = windows.subset(slice(i, i + batch_size))
        out = model(torch.from_numpy(part.x), _text(text, part.text_id))
        preds.append(out.prediction.numpy())
        for b, block in enumerate(out.experts):
            for name, e in block.items():
                experts.setdefault(f"b{b}/{name}", []).append(e.numpy())
    return Prediction(np.concatenate(preds), {k: np.concatenate(v) for k, v in experts.items()})


def fit(
    model: PatchForecaster,
    train: WindowSet,
    val: WindowSet,
    text: Tensor | None,
    config: ForecastConfig,
    seed: int,
) -> list[float]:
    """Train ``model`` for ``config.epochs`` epochs; load the best validation epoch's weights.

    Returns:
        The validation MSE after every epoch.
    Raises:
        TrainingDivergedError: a non-finite training loss (names the epoch).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    x_all, y_all = torch.from_numpy(train.x), torch.from_numpy(train.y)
    best, best_state, curve = float("inf"), None, []
    for epoch in range(config.epochs):
        model.train()
        order = torch.randperm(len(train), generator=gen)
        for i in range(0, len(train), config.batch_size):
            idx = order[i : i + config.batch_size]
            out = model(x_all[idx], _text(text, train.text_id[idx.numpy()]))
            loss = torch.nn.functional.mse_loss(out.prediction, y_all[idx]) + out.aux_loss
            if not torch.isfinite(loss):
                raise TrainingDivergedError(
                    f"training loss is {loss.item()} in epoch {epoch}; lower lr"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        mse = float(np.mean((predict(model, val, text).prediction - val.y) ** 2))
        curve.append(mse)
        if mse < best:
            best, best_state = mse, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    model.eval()
    return curve
