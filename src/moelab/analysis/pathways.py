"""Cross-layer expert pathways: top-1 transitions between adjacent layers and their NMI.

The transition matrix ``M[a, b] = #{tokens with top-1 expert a at layer l and b at layer l+1}``
is the inter-layer expert affinity of Yao et al. ("Exploiting Inter-Layer Expert Affinity for
Accelerating Mixture-of-Experts Model Inference", IPDPS 2024, arXiv:2401.08383), restricted to
top-1 choices. Pathway consistency is the normalised mutual information between the two top-1
labelings with **arithmetic-mean normalisation** ``I / ((H_l + H_{l+1}) / 2)`` (Vinh, Epps & Bailey,
"Information Theoretic Measures for Clusterings Comparison", JMLR 2010; scikit-learn's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.analysis._common import check_records, nmi_from_contingency, to_list
from moelab.core.telemetry import RoutingRecord


@dataclass(frozen=True)
class Transition:
    """Top-1 transitions from layer ``src`` to layer ``dst``.

    Attributes:
        counts: ``[E_src, E_dst]`` int64 token counts.
        probs: ``[E_src, E_dst]`` float64 row-normalised ``P(dst = b | src = a)`` (zero rows stay 0).
        nmi: arithmetic-mean NMI of the two top-1 labelings, in ``[0, 1]``.
        num_tokens: tokens valid in both layers.
    """

    src: int
    dst: int
    counts: Tensor
    probs: Tensor
    nmi: float
    num_tokens: int

    def to_dict(self) -> dict:
        return {
            "src": self.src,
            "dst": self.dst,
            "counts": to_list(self.counts),
            "probs": to_list(self.probs),
            "nmi": self.nmi,
            "num_tokens": self.num_tokens,
        }


def transition_counts_from_labels(top1_a: Tensor, top1_b: Tensor, num_a: int, num_b: int) -> Tensor:
    """``[num_a, num_b]`` int64 contingency table of two ``[N]`` label vectors."""
    if top1_a.shape != top1_b.shape or top1_a.dim() != 1:
        raise ValueError(
            f"label vectors must be 1-D of one length, got {tuple(top1_a.shape)}, "
            f"{tuple(top1_b.shape)}"
        )
    flat = top1_a.long() * num_b + top1_b.long()
    return torch.bincount(flat, minlength=num_a * num_b).reshape(num_a, num_b)


def row_normalize(counts: Tensor) -> Tensor:
    """``counts[a, b] / Σ_b counts[a, b]`` in float64; all-zero rows stay zero."""
    c = counts.double()
    s = c.sum(1, keepdim=True)
    return torch.where(s > 0, c / s.clamp_min(1.0), torch.zeros_like(c))


def transition(
    records_src: Sequence[RoutingRecord],
    records_dst: Sequence[RoutingRecord],
    src: int = 0,
    dst: int = 1,
) -> Transition:
    """Top-1 transition matrix and NMI between two layers that saw the same tokens.

    ``records_src[b]`` and ``records_dst[b]`` must be the same batch (same T) at the two layers.
    Top-1 is ``record.top1`` (argmax of the router probabilities, which for token-choice routing is
    the first dispatched expert). Only tokens valid in both records count.

    Raises:
        ValueError: when the record lists differ in length or a batch differs in T.
    """
    e_src = check_records(records_src, "records_src")
    e_dst = check_records(records_dst, "records_dst")
    if len(records_src) != len(records_dst):
        raise ValueError(
            f"records_src and records_dst must pair batches one to one, got "
            f"{len(records_src)} and {len(records_dst)} records"
        )
    counts = torch.zeros(e_src, e_dst, dtype=torch.long)
    for b, (ra, rb) in enumerate(zip(records_src, records_dst, strict=True)):
        if ra.probs.shape[0] != rb.probs.shape[0]:
            raise ValueError(
                f"batch {b}: layer {src} saw T={ra.probs.shape[0]} tokens but layer {dst} "
                f"saw T={rb.probs.shape[0]}"
            )
        mask = (ra.token_mask.bool() & rb.token_mask.bool()).cpu()
        counts += transition_counts_from_labels(
            ra.top1.cpu()[mask], rb.top1.cpu()[mask], e_src, e_dst
        )
    return transition_from_counts(counts, src, dst)


def transition_from_counts(counts: Tensor, src: int, dst: int) -> Transition:
    """The :class:`Transition` of a ``[E_src, E_dst]`` top-1 contingency table."""
    return Transition(
        src=src,
        dst=dst,
        counts=counts,
        probs=row_normalize(counts),
        nmi=nmi_from_contingency(counts),
        num_tokens=int(counts.sum()),
    )


def transitions(records_by_layer: Sequence[Sequence[RoutingRecord]]) -> list[Transition]:
    """:func:`transition` for every pair of adjacent layers ``(l, l+1)``; ``L - 1`` entries."""
    return [
        transition(records_by_layer[i], records_by_layer[i + 1], i, i + 1)
        for i in range(len(records_by_layer) - 1)
    ]
