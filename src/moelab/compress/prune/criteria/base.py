"""The one interface of an expert-pruning criterion.

A criterion sees a layer's calibration traffic through an *accumulator* (an object with
``update(layer, x, out)``, fed by :func:`moelab.compress.calibration.route`) and then picks the
experts to keep from it. :class:`ScoreCriterion` is the common case: a per-expert score from the
streaming :class:`~moelab.compress.stats.LayerStats`, keep the highest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from moelab.compress.stats import LayerStats
from moelab.core.layer import MoELayer


@dataclass
class Selection:
    """What a criterion chose for one layer.

    Attributes:
        keep: kept expert indices, ascending.
        scores: the per-expert score the choice ranks by (higher = kept first), or None.
        details: other per-expert values worth reporting (e.g. ``{"esn": [...]}``).
    """

    keep: list[int]
    scores: list[float] | None = None
    details: dict[str, list[float]] = field(default_factory=dict)


class Criterion(ABC):
    """An expert-pruning criterion.

    Class attributes:
        name: the CLI name (``--method``).
        sequential: True for layer-wise methods whose statistics of layer l are gathered on
            the model whose layers before l are already pruned (RaGEP's Stage 2); False when
            one pass over the unpruned model serves every layer.
    """

    name: ClassVar[str]
    sequential: ClassVar[bool] = False

    @abstractmethod
    def accumulator(self, layer: MoELayer, n_keep: int) -> Any:
        """A fresh accumulator for ``layer`` (an object with ``update(layer, x, out)``)."""

    @abstractmethod
    def select(self, acc: Any, n_keep: int) -> Selection:
        """Choose ``n_keep`` experts from a filled accumulator."""

    def check_layer(self, layer: MoELayer, where: str) -> None:
        """Raise ValueError, naming ``where``, when this criterion cannot score ``layer``
        (called for every layer before any calibration pass; most criteria take any)."""
        return None

    def options(self) -> dict[str, Any]:
        """The criterion's settings, for reports."""
        return {}


def top_n(scores: Tensor, n: int, *, prefer_high_index: bool = False) -> list[int]:
    """Indices of the ``n`` highest scores, ascending. Ties go to the lower index, or with
    ``prefer_high_index`` to the higher one (the authors' ``argsort(s)[::-1]``, with a stable
    sort: their NumPy default sort orders ties machine-dependently)."""
    s = scores.to(torch.float64)
    if prefer_high_index:
        order = torch.argsort(s, stable=True).flip(0)
    else:
        order = torch.argsort(-s, stable=True)
    return sorted(order[:n].tolist())


class ScoreCriterion(Criterion):
    """Keep the experts with the highest per-expert score computed from :class:`LayerStats`.

    Class attributes:
        directions: the score needs the per-expert direction moments (``E·D²`` memory).
    """

    directions: ClassVar[bool] = False

    def accumulator(self, layer: MoELayer, n_keep: int) -> LayerStats:
        return LayerStats(
            layer.experts.num_experts,
            layer.config.experts.hidden_size,
            directions=self.directions,
        )

    @abstractmethod
    def scores(self, stats: LayerStats) -> tuple[Tensor, dict[str, Tensor]]:
        """``([E] float64 score, {name: [E] detail})``."""

    def select(self, acc: LayerStats, n_keep: int) -> Selection:
        score, details = self.scores(acc)
        return Selection(
            keep=top_n(score, n_keep),
            scores=score.tolist(),
            details={k: v.tolist() for k, v in details.items()},
        )
