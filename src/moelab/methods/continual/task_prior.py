"""SAME's inference-time task prior (Prism's ``RouterIntegration``,
``method/custom/specialized_integration.py`` @ 7154be2a, lines 592–1061; ``wave3-continual.md``
§3.1 correction 1), text-only.

One running-mean anchor per task of a "text" and an "image" feature of the training inputs
(``_update_running_prototypes``). At test, ``sim_t = w·cos(text, a_t) + (1 − w)·cos(image,
b_t)`` (w = 0.8, line 883) and ``π = softmax(28·sim)`` over the tasks (lines 744–751); SAME's
layers keep the top-2 of ``π ⊙ ḡ``. Anchors of tasks not seen yet are zeros here, so their
cosine is 0 (the authors' are ``0.1·randn``, whose cosine is near 0) [I]. Text-only stand-ins
[I]: "text" is the frozen encoder's embedding of instruction + input, "image" that of the
input alone. MoELoRA has no prior [C].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError


class TaskPrior(nn.Module):
    """Prototype anchors ``[T, D]`` for ``T`` tasks and the prior ``π [B, T]``.

    Args:
        num_tasks: T.
        dim: D.
        scale: the softmax scale (28 [C]).
        text_weight: w (0.8 [C]).
    """

    def __init__(self, num_tasks: int, dim: int, scale: float = 28.0, text_weight: float = 0.8):
        super().__init__()
        self.scale, self.text_weight = float(scale), float(text_weight)
        self.register_buffer("text_anchors", torch.zeros(num_tasks, dim))
        self.register_buffer("image_anchors", torch.zeros(num_tasks, dim))
        self.register_buffer("counts", torch.zeros(num_tasks))

    @torch.no_grad()
    def update(self, t: int, text: Tensor, image: Tensor) -> None:
        """Fold ``text [B, D]`` and ``image [B, D]`` into task ``t``'s running means.

        Raises:
            InvalidValueError: ``t`` outside ``[0, T)``.
        """
        if not 0 <= t < self.counts.numel():
            raise InvalidValueError(f"t: must be in [0, {self.counts.numel()}), got {t}")
        n, b = self.counts[t], text.shape[0]
        for anchors, feats in ((self.text_anchors, text), (self.image_anchors, image)):
            anchors[t] = (anchors[t] * n + feats.sum(0)) / (n + b)
        self.counts[t] = n + b

    def forward(self, text: Tensor, image: Tensor) -> Tensor:
        """``π [B, T]`` = softmax over tasks of ``scale · (w·cos(text, a) + (1 − w)·cos(image,
        b))``."""
        sim_t = F.cosine_similarity(text.unsqueeze(1), self.text_anchors.unsqueeze(0), dim=-1)
        sim_i = F.cosine_similarity(image.unsqueeze(1), self.image_anchors.unsqueeze(0), dim=-1)
        sim = self.text_weight * sim_t + (1.0 - self.text_weight) * sim_i
        return torch.softmax(self.scale * sim, dim=-1)
