"""What every continual learner here shares: the stream, the cached frozen encoder, batches,
the CosFace loss, and prediction among the allowed classes.

A learner's life is ``learn(0)``, evaluate, ``learn(1)``, evaluate, ... (:func:`run_stream`
in :mod:`moelab.methods.continual.loop`); :meth:`Learner.logits` scores test texts against
every class known so far.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.methods.continual.backbone import PrefixCache, adapted_forward
from moelab.methods.continual.config import ContinualConfig
from moelab.methods.continual.stream import Stream
from moelab.models.encoder import BertEncoder, pool


def cosface(cosines: Tensor, target: Tensor, scale: float, margin: float) -> Tensor:
    """CosFace (Wang et al., CVPR 2018, arXiv 1801.09414): ``CE(s · (cos - m·onehot(y)))``,
    CaRE's ``AngularPenaltySMLoss(loss_type="cosface")`` [C]."""
    shifted = cosines - margin * F.one_hot(target, cosines.shape[-1]).to(cosines.dtype)
    return F.cross_entropy(scale * shifted, target)


class Learner(ABC):
    """Base of the learners (CaRE and the baselines).

    Args:
        config: the run's settings.
        stream: the task sequence.
        encoder: the frozen encoder (eval mode).
        cache: hidden states entering the first adapted block, for every stream text.
        seed: seeds the learner's data order (weights draw from torch's global generator,
            which :func:`moelab.methods.runner.run_seeds` seeds).
    """

    def __init__(
        self,
        config: ContinualConfig,
        stream: Stream,
        encoder: BertEncoder,
        cache: PrefixCache,
        seed: int,
    ) -> None:
        self.config = config
        self.stream = stream
        self.encoder = encoder.eval().requires_grad_(False)
        self.cache = cache
        self.start_block = cache.start_block
        self.generator = torch.Generator().manual_seed(seed)
        self.tasks_learned = 0
        self.model = nn.ModuleDict()

    # -- data -------------------------------------------------------------------------------
    def labels(self, indices: Sequence[int]) -> Tensor:
        return torch.tensor([self.stream.labels[i] for i in indices], dtype=torch.long)

    def hidden(self, indices: Sequence[int]) -> tuple[Tensor, Tensor]:
        return self.cache.batch([self.stream.texts[i] for i in indices])

    def shuffled_batches(self, indices: Sequence[int]) -> Iterator[list[int]]:
        """One epoch of ``indices`` in a fresh order, ``batch_size`` at a time."""
        order = torch.randperm(len(indices), generator=self.generator).tolist()
        bs = self.config.batch_size
        for s in range(0, len(order), bs):
            yield [indices[k] for k in order[s : s + bs]]

    def features_with(self, indices: Sequence[int], adapters) -> tuple[Tensor, list]:
        """Mean-pooled last hidden states ``[B, D]`` with ``adapters`` beside the top blocks."""
        h, mask = self.hidden(indices)
        out, sides = adapted_forward(self.encoder, h, mask, self.start_block, adapters)
        return pool(out, mask), sides

    def frozen_features(self, indices: Sequence[int]) -> Tensor:
        """The pretrained encoder's features ``[B, D]`` (no adapters), memoized per text in
        the cache (they never change)."""
        return self.memoized(self.cache.features, indices, self._frozen)

    def _frozen(self, indices: Sequence[int]) -> Tensor:
        n = len(self.encoder.blocks) - self.start_block
        with torch.no_grad():
            return self.features_with(indices, [None] * n)[0]

    def memoized(self, memo: dict[str, Tensor], indices: Sequence[int], compute) -> Tensor:
        """``compute(indices)`` ``[B, F]``, computing only the texts missing from ``memo``."""
        texts = [self.stream.texts[i] for i in indices]
        missing = [i for i, t in zip(indices, texts, strict=True) if t not in memo]
        if missing:
            for i, row in zip(missing, compute(missing), strict=True):
                memo[self.stream.texts[i]] = row
        return torch.stack([memo[t] for t in texts])

    # -- the interface ----------------------------------------------------------------------
    @abstractmethod
    def learn(self, t: int) -> None:
        """Train on task ``t`` (tasks arrive in order)."""

    @abstractmethod
    def logits(self, indices: Sequence[int]) -> Tensor:
        """``[B, C]`` scores of ``indices`` against the ``C`` classes learned so far."""

    def predict(self, indices: Sequence[int], candidates: Sequence[int]) -> Tensor:
        """The predicted stream label ``[B]`` of each text, among ``candidates``."""
        cand = torch.tensor(list(candidates), dtype=torch.long)
        with torch.no_grad():
            scores = self.logits(indices)
        known = cand[cand < scores.shape[1]]
        return known[scores[:, known].argmax(1)]

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict(state)

    @abstractmethod
    def grow_to(self, tasks: int) -> None:
        """Rebuild the structure of a learner that has learned ``tasks`` tasks (for loading)."""
