"""Shared helpers of the analysis metrics: validation, valid top-1 experts, NMI of a contingency table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.core.telemetry import RoutingRecord


def check_records(records: Sequence[RoutingRecord], name: str = "records") -> int:
    """Validate a non-empty list of records of one layer and return its expert count E.

    Raises:
        ValueError: when ``records`` is empty or the records disagree on E.
        TypeError: when an element is not a :class:`RoutingRecord`.
    """
    if len(records) == 0:
        raise ValueError(f"{name} must hold at least one RoutingRecord, got an empty list")
    num_experts = None
    for i, rec in enumerate(records):
        if not isinstance(rec, RoutingRecord):
            raise TypeError(f"{name}[{i}] must be a RoutingRecord, got {type(rec).__name__}")
        if num_experts is None:
            num_experts = rec.num_experts
        elif rec.num_experts != num_experts:
            raise ValueError(
                f"{name}[{i}] has E={rec.num_experts} experts but {name}[0] has E={num_experts}"
            )
    if num_experts is None:
        raise ValueError(f"{name} must hold at least one RoutingRecord, got an empty list")
    return num_experts


def entropy_of_counts(counts: Tensor) -> float:
    """Shannon entropy in nats of the distribution ``counts / counts.sum()`` (0 for empty counts)."""
    c = counts.double().flatten()
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c[c > 0] / total
    return float(-(p * p.log()).sum())


def nmi_from_contingency(joint: Tensor) -> float:
    """Normalised mutual information of two labelings given their contingency table.

    ``NMI = I(X; Y) / ((H(X) + H(Y)) / 2)`` (arithmetic-mean normalisation), with ``joint[a, b]``
    the number of samples labelled ``a`` by X and ``b`` by Y. This is scikit-learn's
    ``normalized_mutual_info_score(average_method="arithmetic")``, including its conventions:
    when both labelings are constant (``H(X) = H(Y) = 0``) the NMI is 1.0; an empty table gives 0.0.
    Result in ``[0, 1]``.
    """
    j = joint.double()
    n = j.sum()
    if n <= 0:
        return 0.0
    row = j.sum(1)
    col = j.sum(0)
    h_x = entropy_of_counts(row)
    h_y = entropy_of_counts(col)
    if h_x == 0.0 and h_y == 0.0:
        return 1.0
    nz = j > 0
    pxy = j[nz] / n
    px_py = (row[:, None] * col[None, :])[nz] / (n * n)
    mi = float((pxy * (pxy / px_py).log()).sum())
    denom = 0.5 * (h_x + h_y)
    return min(max(mi / denom, 0.0), 1.0) if denom > 0 else 0.0


def safe_div(a: float, b: float) -> float:
    """``a / b``, or 0.0 when ``b == 0`` (used for ratios over empty selections, as documented)."""
    return a / b if b != 0 else 0.0


def ln(x: int) -> float:
    return math.log(x) if x > 0 else 0.0


def to_list(t: Tensor) -> list:
    """A tensor as nested Python lists (JSON-serialisable)."""
    return t.detach().cpu().tolist()


def as_long(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x.long()
