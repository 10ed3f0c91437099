"""Next-layer expert prediction for prefetching (the authors' ``experts/expert_predictor.py``,
off by default there): score = 0.8 · the expert's share of all tokens the layer has routed so
far + 0.2 · its share over the layer's last 5 visits; the top-scoring experts are prefetched.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

GLOBAL_WEIGHT = 0.8
WINDOW = 5


class ExpertPredictor:
    """Per-layer routing history of layers with ``experts_per_layer[l]`` experts."""

    def __init__(self, experts_per_layer: Sequence[int], window: int = WINDOW) -> None:
        self.total = [np.zeros(E) for E in experts_per_layer]
        self.recent = [deque(maxlen=window) for _ in experts_per_layer]

    def update(self, layer: int, counts: list[int] | np.ndarray) -> None:
        """Record one visit of ``layer`` with tokens per expert ``counts [E]``."""
        c = np.asarray(counts, dtype=np.float64)
        self.total[layer] += c
        self.recent[layer].append(c)

    def scores(self, layer: int) -> np.ndarray:
        """``[E]`` prediction scores of ``layer``'s next visit."""
        g = self.total[layer]
        r = np.sum(self.recent[layer], axis=0) if self.recent[layer] else np.zeros_like(g)
        share = lambda v: v / v.sum() if v.sum() > 0 else v  # noqa: E731
        return GLOBAL_WEIGHT * share(g) + (1 - GLOBAL_WEIGHT) * share(r)

    def predict(self, layer: int, n: int) -> list[int]:
        """The ``n`` experts most likely needed at ``layer``'s next visit (none before any
        history)."""
        s = self.scores(layer)
        if n <= 0 or not s.any():
            return []
        order = np.argsort(-s, kind="stable")
        return [int(e) for e in order[:n] if s[e] > 0]
