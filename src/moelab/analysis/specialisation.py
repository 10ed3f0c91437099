"""Domain specialisation of experts: domain × expert routing fractions and domain-expert NMI.

The per-domain expert-assignment distribution follows the routing analysis of Mixtral (Jiang et
al., "Mixtral of Experts", 2024, arXiv:2401.04088, Sec. 5, Fig. 7) and of OLMoE (Muennighoff et
al., 2024, arXiv:2409.02060, Sec. 5 "domain specialization"). Summarising it by the normalised
mutual information between the domain label and the chosen expert (arithmetic-mean
normalisation, Vinh, Epps & Bailey, JMLR 2010) is this project's single-number summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.analysis._common import as_long, check_records, nmi_from_contingency, to_list
from moelab.analysis.pathways import row_normalize
from moelab.core.telemetry import RoutingRecord


@dataclass(frozen=True)
class DomainStats:
    """Domain preference of one layer.

    Attributes:
        counts: ``[num_domains, E]`` int64 routed pairs of tokens of domain d to expert e.
        fraction: ``[num_domains, E]`` float64 row-normalised ``P(expert = e | domain = d)``.
        nmi: arithmetic-mean NMI between domain label and chosen expert over pairs, ``[0, 1]``.
    """

    counts: Tensor
    fraction: Tensor
    nmi: float

    def to_dict(self) -> dict:
        return {"counts": to_list(self.counts), "fraction": to_list(self.fraction), "nmi": self.nmi}


def split_domains(
    domains: Tensor | Sequence[Tensor], records: Sequence[RoutingRecord]
) -> list[Tensor]:
    """Per-record ``[T_b]`` int64 domain labels.

    ``domains`` is either a list with one ``[T_b]`` tensor per record, or one tensor of the
    labels of all records concatenated in record order (``[Σ_b T_b]``; a ``[B, S]`` tensor is
    flattened first).

    Raises:
        ValueError: when the lengths do not match the records' token counts.
    """
    sizes = [int(r.probs.shape[0]) for r in records]
    if isinstance(domains, Tensor):
        flat = as_long(domains, "domains").reshape(-1).cpu()
        if flat.numel() != sum(sizes):
            raise ValueError(
                f"domains has {flat.numel()} labels but the records hold {sum(sizes)} tokens "
                f"({sizes}); pass the labels of all records concatenated in record order"
            )
        return list(flat.split(sizes))
    if len(domains) != len(records):
        raise ValueError(f"domains lists {len(domains)} tensors for {len(records)} records")
    out = []
    for b, (d, n) in enumerate(zip(domains, sizes, strict=True)):
        d = as_long(d, f"domains[{b}]").reshape(-1).cpu()
        if d.numel() != n:
            raise ValueError(f"domains[{b}] has {d.numel()} labels but record {b} has T={n}")
        out.append(d)
    return out


def domain_expert_counts(
    records: Sequence[RoutingRecord],
    domains: Tensor | Sequence[Tensor],
    num_domains: int | None = None,
) -> Tensor:
    """``[num_domains, E]`` int64: ``counts[d, e] = #{dispatched pairs (t, e): domain[t] = d}``.

    Args:
        records: one layer's records.
        domains: per-token int labels in ``[0, num_domains)``, see :func:`split_domains`.
        num_domains: number of domains; default ``max(label) + 1``.

    Raises:
        ValueError: for negative labels or labels ``>= num_domains``.
    """
    num_experts = check_records(records)
    per_record = split_domains(domains, records)
    max_label = max((int(d.max()) for d in per_record if d.numel()), default=-1)
    min_label = min((int(d.min()) for d in per_record if d.numel()), default=0)
    if min_label < 0:
        raise ValueError(f"domain labels must be >= 0, got {min_label}")
    if num_domains is None:
        num_domains = max_label + 1
    if max_label >= num_domains:
        raise ValueError(f"domain label {max_label} is out of range [0, {num_domains})")
    counts = torch.zeros(num_domains * num_experts, dtype=torch.long)
    for r, d in zip(records, per_record, strict=True):
        dom = d[r.token_idx.long().cpu()]
        counts += torch.bincount(
            dom * num_experts + r.expert_idx.long().cpu(), minlength=num_domains * num_experts
        )
    return counts.reshape(num_domains, num_experts)


def domain_stats(
    records: Sequence[RoutingRecord],
    domains: Tensor | Sequence[Tensor],
    num_domains: int | None = None,
) -> DomainStats:
    """Domain × expert routing fractions and NMI(domain; expert) of one layer.

    ``fraction[d, e] = counts[d, e] / Σ_e' counts[d, e']``; ``nmi = I(D; X) / ((H(D) + H(X)) / 2)``
    over the joint distribution ``counts / Σ counts`` of dispatched pairs (each pair is one
    sample: with top-k routing a token contributes k samples). A router that sends domain A only
    to expert 0 and domain B only to expert 1 gives NMI 1; routing independent of the domain ≈ 0.
    """
    return domain_stats_from_counts(domain_expert_counts(records, domains, num_domains))


def domain_stats_from_counts(counts: Tensor) -> DomainStats:
    """The :class:`DomainStats` of a ``[num_domains, E]`` domain × expert count table."""
    return DomainStats(
        counts=counts, fraction=row_normalize(counts), nmi=nmi_from_contingency(counts)
    )
