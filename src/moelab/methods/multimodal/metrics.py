"""Classification metrics of the EEG-MoCE recipe: balanced accuracy and macro-F1 (the
authors' reported metrics, sklearn's definitions)."""

from __future__ import annotations

import numpy as np


def balanced_accuracy(y: np.ndarray, pred: np.ndarray) -> float:
    """Mean over the classes present in ``y`` of the per-class recall."""
    return float(np.mean([np.mean(pred[y == c] == c) for c in np.unique(y)]))


def macro_f1(y: np.ndarray, pred: np.ndarray) -> float:
    """Unweighted mean of ``2·TP / (2·TP + FP + FN)`` over the classes that occur in ``y`` or
    ``pred`` (so no class has a zero denominator)."""
    scores = []
    for c in np.union1d(np.unique(y), np.unique(pred)):
        tp = np.sum((pred == c) & (y == c))
        fp = np.sum((pred == c) & (y != c))
        fn = np.sum((pred != c) & (y == c))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))
