"""TiMi: text about the future steering time-series experts through a multimodal MoE plug-in.

Paper: Lin, Wang, Luo, Pei, Wang, "TiMi: Empower Time Series Transformers with Multimodal
Mixture of Experts", ICML 2026, arXiv 2602.21693 (METHODS.md #8). No public code; the only
description of the internals is a secondary summary ([S], ``shared/research/wave3-science.md``
§2.1-2.2).

Follows [S]: a frozen LLM's mean-pooled hidden states as one text token; PatchTST-style
patches; the MMoE plug-in in the FFN slot: a text-routed MoE (TMoE) and a series-routed MoE
(SMoE, routed by all temporal tokens), both sample-level, outputs summed
(:mod:`.mmoe`, on :class:`moelab.core.layer.MoELayer`'s ``router_input`` seam); MSE/MAE.

This project's reading [I]: PatchTST-lite at CPU scale (d = 32, 2 blocks, 41 patches, RevIN;
:mod:`.model`); E = 4, k = 2, GELU experts, balance loss 1e-2; SmolLM2-135M as the frozen LM
with per-dimension z-scoring of its vectors (MiniLM as the ablation; :mod:`.text`); no
per-sample LLM "inference" text; the data: the real ``taylor`` demand series with synthetic,
announced events (:mod:`moelab.data.forecast_events`), or a user CSV.

Entry points: :class:`~.recipe.TiMiRecipe` (for :func:`moelab.methods.runner.run_seeds`),
:func:`~.run.train_forecaster`, :func:`~.run.evaluate_forecaster`; ``moelab forecast
train``; ``benchmarks/timi.py``.
"""

from moelab.methods.forecasting.config import ARMS, ForecastConfig
from moelab.methods.forecasting.mmoe import DenseFFN, MMoE, SlotOutput
from moelab.methods.forecasting.model import ForecastOutput, PatchForecaster
from moelab.methods.forecasting.recipe import TiMiRecipe
from moelab.methods.forecasting.revin import RevIN
from moelab.methods.forecasting.run import (
    ForecastRun,
    evaluate_forecaster,
    load_data,
    shuffle_texts,
    train_forecaster,
)
from moelab.methods.forecasting.text import TextCache, load_text_encoder

__all__ = [
    "ARMS",
    "DenseFFN",
    "ForecastConfig",
    "ForecastOutput",
    "ForecastRun",
    "MMoE",
    "PatchForecaster",
    "RevIN",
    "SlotOutput",
    "TextCache",
    "TiMiRecipe",
    "evaluate_forecaster",
    "load_data",
    "load_text_encoder",
    "shuffle_texts",
    "train_forecaster",
]
