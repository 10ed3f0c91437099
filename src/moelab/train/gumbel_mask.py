"""A per-layer Gumbel-softmax mask: a differentiable keep/grow choice per candidate site.

Each site ``l`` has two logits ``α_l = (keep, grow)``. A sample is the Gumbel-softmax
(Jang et al., ICLR 2017, arXiv 1611.01144; Maddison et al., arXiv 1611.00712)
``y = softmax((α_l + g) / τ)`` with ``g ~ Gumbel(0, 1)``, made hard with the straight-through
estimator: the forward value is the one-hot ``argmax`` and the gradient is the soft sample's,
``m = onehot − stop_grad(y) + y``. The growth decision is ``m_l = m[l, grow]``, 0 or 1.
The selective-upcycling method (ICML 2026 poster 64571, whose outer loop is this mask; the
rest of its description is unpublished) anneals ``τ`` from 1 to 0.1
(:func:`annealed_temperature`, [I] geometric) and finally keeps the sites whose
``argmax α_l`` is grow (:meth:`GumbelLayerMask.decide`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError


class GumbelLayerMask(nn.Module):
    """Keep/grow logits ``alpha [L, 2]`` (zeros at init: P(grow) = 0.5).

    Args:
        num_sites: L >= 1.
    """

    GROW = 1

    def __init__(self, num_sites: int) -> None:
        super().__init__()
        if not isinstance(num_sites, int) or num_sites < 1:
            raise InvalidValueError(f"num_sites: must be an int >= 1, got {num_sites!r}")
        self.alpha = nn.Parameter(torch.zeros(num_sites, 2))

    def sample(self, tau: float, generator: torch.Generator | None = None) -> Tensor:
        """Hard straight-through sample ``m [L]`` float32 of 0/1 growth decisions.

        Raises:
            InvalidValueError: ``tau <= 0``.
        """
        if not tau > 0:
            raise InvalidValueError(f"tau: must be > 0, got {tau!r}")
        u = torch.rand(self.alpha.shape, generator=generator).clamp_(1e-10, 1.0 - 1e-7)
        soft = F.softmax((self.alpha - torch.log(-torch.log(u))) / tau, dim=-1)
        hard = F.one_hot(soft.argmax(-1), 2).to(soft.dtype)
        return (hard - soft.detach() + soft)[:, self.GROW]

    def grow_probs(self) -> Tensor:
        """``P(grow) [L] = softmax(α_l)[grow]`` (differentiable; the size penalty's weights)."""
        return F.softmax(self.alpha, dim=-1)[:, self.GROW]

    def decide(self) -> list[bool]:
        """The discretised mask: site ``l`` grows iff ``α_l[grow] > α_l[keep]``."""
        return [bool(v) for v in (self.alpha[:, self.GROW] > self.alpha[:, 0]).tolist()]


def annealed_temperature(step: int, total: int, start: float = 1.0, end: float = 0.1) -> float:
    """Geometric annealing ``start · (end/start)^(step / max(total - 1, 1))``: ``start`` at
    step 0, ``end`` at step ``total - 1``.

    Raises:
        InvalidValueError: a temperature <= 0 or ``total`` < 1.
    """
    if not (start > 0 and end > 0) or total < 1:
        raise InvalidValueError(
            f"start, end, total: need start > 0, end > 0, total >= 1, got {start}, {end}, {total}"
        )
    return start * (end / start) ** (min(step, total - 1) / max(total - 1, 1))
