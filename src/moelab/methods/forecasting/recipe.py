"""The TiMi recipe for :func:`moelab.methods.runner.run_seeds`: one arm, one seed, metrics.

Arms are :class:`~moelab.methods.forecasting.config.ForecastConfig` variants (``arm``,
``variant``). The recipe keeps one text cache for all runs (each distinct notice is encoded
once) and the windows of the current seed, so every arm of a seed sees the same events.
"""

from __future__ import annotations

import numpy as np

from moelab.data.timeseries import ForecastData
from moelab.methods.forecasting.config import ForecastConfig
from moelab.methods.forecasting.run import evaluate_forecaster, load_data, train_forecaster
from moelab.methods.forecasting.text import TextCache

_DATA_FIELDS = ("data_path", "variant", "lookback", "horizon", "stride", "event_probability")


class TiMiRecipe:
    """``run(config, seed) -> metrics`` (names in :func:`evaluate_forecaster`).

    Args:
        cache: the text cache (default: one of the first config's encoder and cache file).
        series: a series to use instead of taylor (tests).
    """

    name = "timi"

    def __init__(self, cache: TextCache | None = None, series: np.ndarray | None = None) -> None:
        self.cache = cache
        self._series = series
        self._data: dict[tuple, ForecastData] = {}

    def data(self, config: ForecastConfig, seed: int) -> ForecastData:
        key = (seed, *(getattr(config, f) for f in _DATA_FIELDS))
        if key not in self._data:
            self._data = {k: v for k, v in self._data.items() if k[0] == seed}
            self._data[key] = load_data(config, seed, self._series)
        return self._data[key]

    def run(self, config: ForecastConfig, seed: int) -> dict[str, float]:
        if self.cache is None and config.uses_text:
            self.cache = TextCache(config.text_encoder, path=config.text_cache)
        run = train_forecaster(config, seed, self.data(config, seed), self.cache)
        return evaluate_forecaster(run)
