"""Classifier heads of the continual-learning recipes.

* :class:`CosineHead`: a growing cosine classifier, one bias-free ``Linear`` per task
  (PILOT's ``TunaLinear``: ``logits = cos(x, w_c)``, unscaled, in ``[-1, 1]``; weights
  trunc-normal(0.02)). Every head stays trainable, as CaRE's ``update(nb, freeze_old=False)``
  [C].
* :class:`PrototypeHead`: cosine similarity to stored class prototypes (class-mean
  features: SimpleCIL and APER, Zhou et al., IJCV 2024, arXiv 2303.07338), also the zero-shot
  label-prompt head (:func:`label_prompt_head`: prototypes are the encodings of a prompt per
  class name, CLIP-style zero-shot transfer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError


class CosineHead(nn.Module):
    """``[B, D]`` features → ``[B, C]`` cosines with the class weights of every task so far.

    Args:
        dim: D.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.heads = nn.ModuleList()

    @property
    def num_classes(self) -> int:
        return sum(h.out_features for h in self.heads)

    def grow(self, n: int) -> None:
        """Append a head for ``n`` new classes (trunc-normal(0.02) weights, as ``TunaLinear``)."""
        if n < 1:
            raise InvalidValueError(f"n: must be >= 1, got {n}")
        head = nn.Linear(self.dim, n, bias=False)
        nn.init.trunc_normal_(head.weight, std=0.02)
        self.heads.append(head)

    def forward(self, x: Tensor) -> Tensor:
        if not self.heads:
            raise InvalidValueError("CosineHead: no classes yet (call grow first)")
        w = torch.cat([h.weight for h in self.heads])
        return F.linear(F.normalize(x, dim=-1), F.normalize(w, dim=-1))


class PrototypeHead(nn.Module):
    """Cosine similarity to class prototypes: ``[B, D]`` → ``[B, C]``.

    Prototypes are a buffer ``[C, D]`` that :meth:`add_classes` extends with the mean feature
    of each new class (SimpleCIL's rule: prototypes of old classes never change).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("prototypes", torch.zeros(0, dim))

    @property
    def num_classes(self) -> int:
        return self.prototypes.shape[0]

    def add_classes(self, features: Tensor, labels: Tensor, classes: Sequence[int]) -> None:
        """Append the mean of ``features [N, D]`` over ``labels == c`` for each ``c`` in
        ``classes``, which must be the next class ids ``C, C+1, ...``.

        Raises:
            InvalidValueError: classes out of sequence, or one with no feature.
        """
        rows = []
        for i, c in enumerate(classes):
            if c != self.num_classes + i:
                raise InvalidValueError(f"classes: expected class {self.num_classes + i}, got {c}")
            sel = labels == c
            if not bool(sel.any()):
                raise InvalidValueError(f"class {c}: no features to average")
            rows.append(features[sel].mean(0))
        self.prototypes = torch.cat([self.prototypes, torch.stack(rows).to(self.prototypes)])

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.normalize(x, dim=-1), F.normalize(self.prototypes, dim=-1))


def label_prompt_head(
    encode: Callable[[list[str]], Tensor], names: Sequence[str], template: str = "{}"
) -> PrototypeHead:
    """A zero-shot head whose prototype of class ``c`` is ``encode([template.format(name)])``.

    Args:
        encode: texts → ``[N, D]`` features (e.g. ``lambda t: encoder.encode(t, tokenizer)``).
        names: class names, in label order.
        template: the prompt, ``"{}"`` replaced by the name.
    """
    feats = encode([template.format(n) for n in names])
    head = PrototypeHead(feats.shape[-1])
    head.prototypes = feats.detach().float().clone()
    return head
