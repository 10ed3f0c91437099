"""The linear single-modality reference: L2-regularised logistic regression on modality A.

The research spec's probe (``wave3-science.md`` §1.3: 0.881 balanced accuracy on SCP1's test
split) [I]: A's z-scored signals block-mean downsampled by ``linear_factor``, flattened,
standardised with the training statistics, and fitted by L-BFGS on the mean cross-entropy plus
``linear_l2·‖W‖²/2`` (float64, the bias unpenalised). It trains on all training anchors
(train + validation: nothing is early-stopped).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from moelab.data.eeg import block_mean


def features(x: np.ndarray, factor: int) -> np.ndarray:
    """``[N, C, L] → [N, C·(L // factor)]`` block means."""
    return block_mean(x, factor).reshape(len(x), -1)


def fit_logreg(
    X: np.ndarray, y: np.ndarray, num_classes: int, l2: float, max_iter: int = 500
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fit multinomial logistic regression; returns ``(W [F, C], b [C], mean, std)`` where
    ``mean``/``std`` standardise the features (apply as ``((X − mean)/std) @ W + b``)."""
    mean, std = X.mean(0), X.std(0) + 1e-8
    Xt = torch.from_numpy((X - mean) / std)
    yt = torch.from_numpy(y)
    W = torch.zeros(X.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(Xt @ W + b, yt) + 0.5 * l2 * (W * W).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return W.detach().numpy(), b.detach().numpy(), mean, std


def predict_logreg(X: np.ndarray, params: tuple[np.ndarray, ...]) -> np.ndarray:
    """Class predictions ``[N]`` of :func:`fit_logreg`'s parameters."""
    W, b, mean, std = params
    return (((X - mean) / std) @ W + b).argmax(-1)
