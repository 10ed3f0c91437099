"""One TiMi arm end to end: its data, its text vectors, training and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from moelab.data.forecast_events import make_event_windows
from moelab.data.timeseries import (
    ForecastData,
    WindowSet,
    load_series_csv,
    load_taylor,
    windows_from_series,
)
from moelab.methods.forecasting.config import ForecastConfig
from moelab.methods.forecasting.metrics import forecast_errors, routing_purity, usage_matrix
from moelab.methods.forecasting.model import PatchForecaster
from moelab.methods.forecasting.text import TextCache, zscore_stats
from moelab.methods.forecasting.train import fit, predict


def load_data(config: ForecastConfig, seed: int, series: np.ndarray | None = None) -> ForecastData:
    """The windows of ``config``: a user CSV's, or taylor's (or ``series``') with events
    injected for ``seed``.

    Raises:
        CorpusError: an unreadable CSV; CorpusNotInstalledError: pmdarima missing.
        InvalidValueError: a series shorter than one window, or a split left empty.
    """
    c = config
    if c.data_path is not None:
        return windows_from_series(
            load_series_csv(c.data_path), lookback=c.lookback, horizon=c.horizon, stride=c.stride
        )
    return make_event_windows(
        load_taylor() if series is None else series,
        variant=c.variant,
        seed=seed,
        lookback=c.lookback,
        horizon=c.horizon,
        stride=c.stride,
        probability=c.event_probability,
    )


def shuffle_texts(windows: WindowSet, rng: np.random.Generator) -> WindowSet:
    """The same windows with their texts permuted among them (the shuffled-text control):
    only ``text_id`` changes."""
    return replace(windows, text_id=windows.text_id[rng.permutation(len(windows))])


def text_vectors(data: ForecastData, cache: TextCache) -> Tensor:
    """``[n_texts, C]`` float32 vectors of ``data.texts``, z-scored per dimension with the
    mean and std over the train windows (each window counts once)."""
    vectors = cache.encode(list(data.texts))
    mean, std = zscore_stats(vectors[torch.from_numpy(data.train.text_id)])
    return (vectors - mean) / std


@dataclass
class ForecastRun:
    """A trained arm: its config, seed, data (texts shuffled for the control), text vectors
    (None for text-free arms), model and validation curve."""

    config: ForecastConfig
    seed: int
    data: ForecastData
    text: Tensor | None
    model: PatchForecaster
    val_curve: list[float]


def train_forecaster(
    config: ForecastConfig, seed: int, data: ForecastData, cache: TextCache | None = None
) -> ForecastRun:
    """Build and train ``config.arm`` on ``data`` with the global RNG as the caller seeded it
    (the runner seeds it per run); ``cache`` encodes the texts of text arms (default: a
    memory cache of ``config.text_encoder``, or its ``text_cache`` file)."""
    if config.arm == "shuffled":
        rng = np.random.default_rng([seed, 1])
        data = replace(
            data,
            train=shuffle_texts(data.train, rng),
            val=shuffle_texts(data.val, rng),
            test=shuffle_texts(data.test, rng),
        )
    text = None
    if config.uses_text:
        if cache is None:
            cache = TextCache(config.text_encoder, path=config.text_cache)
        text = text_vectors(data, cache)
    model = PatchForecaster(config, 1 if text is None else text.shape[1])
    curve = fit(model, data.train, data.val, text, config, seed)
    return ForecastRun(config, seed, data, text, model, curve)


def evaluate_forecaster(run: ForecastRun) -> dict[str, float]:
    """Test metrics: :func:`forecast_errors`, ``mse/<event type>``, and for MoE arms the
    expert usage ``usage/b<block>/<tmoe|smoe>/<type>/e<expert>``, the routing purity
    ``purity/b<block>/<moe>`` and its input-blind value ``purity_chance``."""
    test, names = run.data.test, run.data.event_names
    out = predict(run.model, test, run.text)
    metrics = forecast_errors(out.prediction, test.y, test.event)
    for t, name in enumerate(names):
        rows = test.event == t
        if t > 0 and rows.any():
            metrics[f"mse/{name}"] = float(np.mean((out.prediction[rows] - test.y[rows]) ** 2))
    if out.experts:
        counts = np.bincount(test.event, minlength=len(names))
        metrics["purity_chance"] = float(counts.max() / counts.sum())
    for key, experts in out.experts.items():
        m = usage_matrix(experts, test.event, len(names), run.config.num_experts)
        for t, name in enumerate(names):
            for e in range(m.shape[1]):
                metrics[f"usage/{key}/{name}/e{e}"] = float(m[t, e])
        metrics[f"purity/{key}"] = routing_purity(experts, test.event)
    return metrics
