"""TiMi's evaluation: MSE/MAE on event and event-free windows, and expert usage by event type.

Errors are on the scaled target (values divided by the train std, [S] MSE/MAE; ``wave3``
§2.4), averaged over windows and horizon steps. Expert usage is TiMi's interpretability view
[S]: for each event type, the share of its windows that route to each expert (a row sums to
k). Routing purity (cluster purity of the windows' expert sets against their event types,
Manning et al., *Introduction to Information Retrieval* §16.3) condenses it to one number;
ignoring the input scores the largest type's share.
"""

from __future__ import annotations

import numpy as np


def forecast_errors(pred: np.ndarray, true: np.ndarray, event: np.ndarray) -> dict[str, float]:
    """``mse``/``mae`` over all windows, ``*_event`` over windows with ``event > 0``,
    ``*_free`` over the others, of ``pred, true [N, H]``; a group with no window is left out."""
    err = pred.astype(np.float64) - true
    out = {"mse": float(np.mean(err**2)), "mae": float(np.mean(np.abs(err)))}
    for name, rows in (("event", event > 0), ("free", event == 0)):
        if rows.any():
            out[f"mse_{name}"] = float(np.mean(err[rows] ** 2))
            out[f"mae_{name}"] = float(np.mean(np.abs(err[rows])))
    return out


def usage_matrix(experts: np.ndarray, event: np.ndarray, num_types: int, num_experts: int):
    """``[num_types, num_experts]`` float64: row ``t`` is the share of type-``t`` windows whose
    experts ``experts [N, k]`` include ``e`` (rows sum to k; an absent type's row is 0)."""
    m = np.zeros((num_types, num_experts))
    np.add.at(m, (np.repeat(event, experts.shape[1]), experts.reshape(-1)), 1.0)
    counts = np.bincount(event, minlength=num_types)[:, None]
    return np.divide(m, counts, out=np.zeros_like(m), where=counts > 0)


def routing_purity(experts: np.ndarray, event: np.ndarray) -> float:
    """Cluster purity of the windows' expert sets (``experts [N, k]``, order ignored) against
    ``event [N]``: ``Σ_set max_t n(set, t) / N``."""
    sets = np.sort(experts, axis=1)
    _, cluster = np.unique(sets, axis=0, return_inverse=True)
    table = np.zeros((cluster.max() + 1, event.max() + 1))
    np.add.at(table, (cluster.reshape(-1), event), 1)
    return float(table.max(axis=1).sum() / len(event))
