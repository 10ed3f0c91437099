"""The baselines of CaRE's comparison that fit a frozen text encoder (``wave3-continual.md``
§1.2), on the same stream, cache and adapter placement as CaRE.

* :class:`SimpleCILLearner` — SimpleCIL (Zhou et al., "Revisiting class-incremental learning
  with pre-trained models", IJCV 2024, arXiv 2303.07338): class-mean prototypes of the frozen
  encoder's features, cosine classifier; nothing is trained.
* :class:`APERLearner` — APER with adapters (same paper; LAMDA-PILOT ``aper_adapter``): an
  AdaptFormer adapter (down → ReLU → up, fixed scale 0.1, up-projection zero at init) beside
  the FFN of each adapted block, trained on task 0 alone with a cosine head and CosFace
  (``first_task_epochs``, SGD, cosine schedule to 0), then frozen; prototypes of the
  concatenated ``[pretrained ‖ adapted]`` features.
* :class:`FinetuneLearner` — sequential fine-tuning, the lower bound: the same adapters and a
  growing cosine head trained on each task in turn with CosFace over every class seen so far
  (no replay, no regulariser), ``first_task_epochs`` then ``epochs`` per task [I: the backbone
  stays frozen, as in every arm].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moelab.methods.continual.heads import CosineHead, PrototypeHead
from moelab.methods.continual.learner import Learner, cosface
from moelab.models.adapters.parallel import ParallelAdapter


def _batched(fn, indices: Sequence[int], size: int = 64) -> Tensor:
    idx = list(indices)
    with torch.no_grad():
        return torch.cat([fn(idx[s : s + size]) for s in range(0, len(idx), size)])


class SimpleCILLearner(Learner):
    """SimpleCIL (module docstring); ``model["head"]`` is the prototype head."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model["head"] = PrototypeHead(self.encoder.cfg.hidden_size)

    def grow_to(self, tasks: int) -> None:
        n = self.stream.seen_classes(tasks - 1) if tasks else 0
        self.model["head"].prototypes = torch.zeros(n, self.encoder.cfg.hidden_size)

    def learn(self, t: int) -> None:
        task = self.stream.tasks[t]
        feats = _batched(self.frozen_features, task.train)
        self.model["head"].add_classes(feats, self.labels(task.train), task.classes)
        self.tasks_learned = t + 1

    def logits(self, indices: Sequence[int]) -> Tensor:
        return self.model["head"](self.frozen_features(indices))


class _AdapterLearner(Learner):
    """Adapters beside the top blocks' FFNs (AdaptFormer's ``"lora"`` init) and a trainable
    cosine head."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        D = self.encoder.cfg.hidden_size
        n = len(self.encoder.blocks) - self.start_block
        self.model["adapters"] = nn.ModuleList(
            ParallelAdapter(D, self.config.adapter_dim, dropout=self.config.adapter_dropout)
            for _ in range(n)
        )
        self.model["cos"] = CosineHead(D)

    def adapted_features(self, indices: Sequence[int]) -> Tensor:
        adapters = [lambda a, m, ad=ad: (ad(a), None) for ad in self.model["adapters"]]
        return self.features_with(indices, adapters)[0]

    def _train(self, t: int, epochs: int, known: int) -> None:
        """``epochs`` epochs on task ``t`` against the head's classes from ``known`` on."""
        c = self.config
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=c.lr, momentum=0.9, weight_decay=c.weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs, eta_min=0.0)
        self.model.train()
        for _ in range(epochs):
            for idx in self.shuffled_batches(self.stream.tasks[t].train):
                cos = self.model["cos"](self.adapted_features(idx))[:, known:]
                loss = cosface(cos, self.labels(idx) - known, c.scale, c.margin)
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        self.model.eval()


class APERLearner(_AdapterLearner):
    """APER-Adapter (module docstring); ``model["head"]`` holds the prototypes of the
    concatenated features."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model["head"] = PrototypeHead(2 * self.encoder.cfg.hidden_size)
        self._adapted: dict[str, Tensor] = {}

    def _concat(self, indices: Sequence[int]) -> Tensor:
        """``[pretrained ‖ adapted]`` features; the adapters are frozen after task 0, so the
        adapted ones are memoized per text."""
        adapted = self.memoized(self._adapted, indices, self._adapted_now)
        return torch.cat([self.frozen_features(indices), adapted], -1)

    def _adapted_now(self, indices: Sequence[int]) -> Tensor:
        with torch.no_grad():
            return self.adapted_features(indices)

    def grow_to(self, tasks: int) -> None:
        if tasks:
            self.model["cos"].grow(len(self.stream.tasks[0].classes))
            self.model.requires_grad_(False)
        n = self.stream.seen_classes(tasks - 1) if tasks else 0
        self.model["head"].prototypes = torch.zeros(n, 2 * self.encoder.cfg.hidden_size)

    def learn(self, t: int) -> None:
        task = self.stream.tasks[t]
        if t == 0:
            self.model["cos"].grow(len(task.classes))
            self._train(0, self.config.first_task_epochs, 0)
            self.model.requires_grad_(False)
        self.model.eval()
        if t == 0:
            self._adapted.clear()
        feats = _batched(self._concat, task.train)
        self.model["head"].add_classes(feats, self.labels(task.train), task.classes)
        self.tasks_learned = t + 1

    def logits(self, indices: Sequence[int]) -> Tensor:
        self.model.eval()
        return self.model["head"](self._concat(indices))


class FinetuneLearner(_AdapterLearner):
    """Sequential fine-tuning (module docstring)."""

    def grow_to(self, tasks: int) -> None:
        for t in range(tasks):
            self.model["cos"].grow(len(self.stream.tasks[t].classes))

    def learn(self, t: int) -> None:
        self.model["cos"].grow(len(self.stream.tasks[t].classes))
        epochs = self.config.first_task_epochs if t == 0 else self.config.epochs
        self._train(t, epochs, 0)
        self.tasks_learned = t + 1

    def logits(self, indices: Sequence[int]) -> Tensor:
        self.model.eval()
        return self.model["cos"](self.adapted_features(indices))
