"""Streaming routing statistics: every metric of :func:`moelab.analysis.analyze` from running sums.

A :class:`RoutingAccumulator` takes one batch at a time (every MoE layer's
:class:`~moelab.core.telemetry.RoutingRecord` of that batch and the tokens' domain labels) and
keeps only fixed-size sums per layer: ``[E]`` pair counts, drops, entropy and margin sums,
``[E, E]`` co-selection counts, adjacent-agreement counts, ``[num_domains, E]`` domain counts
and ``[E_l, E_{l+1}]`` top-1 transition counts. Its memory is independent of the number of
tokens analysed, so the records themselves can be dropped after each batch. The per-record
maths is the one of the list-based metric functions (``load``, ``confidence``, ``coactivation``,
``consistency``, ``specialisation``, ``pathways``), which it reuses.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.analysis._common import as_long, check_records, safe_div
from moelab.analysis.coactivation import selection_matrix, split_gram
from moelab.analysis.confidence import ConfidenceStats, confidence_from_sums, confidence_sums
from moelab.analysis.consistency import Agreement, adjacent_agreement_counts
from moelab.analysis.load import LoadStats, load_stats_from_counts
from moelab.analysis.pathways import (
    Transition,
    transition_counts_from_labels,
    transition_from_counts,
)
from moelab.analysis.specialisation import (
    DomainStats,
    domain_expert_counts,
    domain_stats_from_counts,
)
from moelab.core.telemetry import RoutingRecord


class LayerAccumulator:
    """Running sums of one MoE layer's routing over the batches it has seen.

    Attributes:
        num_experts: E.
        counts: ``[E]`` int64 dispatched pairs per expert.
        dropped: pairs dropped by capacity.
        coselect: ``[E, E]`` float64 ``Σ_batches AᵀA`` (``A`` the 0/1 selection indicator).
        domain_counts: ``[num_domains, E]`` int64, or None until a batch with labels arrives.
    """

    def __init__(self, num_experts: int, num_domains: int | None = None) -> None:
        self.num_experts = num_experts
        self.num_domains = num_domains
        self.num_records = 0
        self.counts = torch.zeros(num_experts, dtype=torch.long)
        self.dropped = 0
        self.entropy_sum = 0.0
        self.margin_sum = 0.0
        self.num_tokens = 0
        self.coselect = torch.zeros(num_experts, num_experts, dtype=torch.float64)
        self.adjacent_matches = 0
        self.adjacent_pairs = 0
        self.domain_counts: Tensor | None = None

    def update(self, record: RoutingRecord, domains: Tensor | None = None) -> None:
        """Add one batch's record; ``domains`` is its ``[T]`` int64 per-token domain labels."""
        self.num_records += 1
        self.counts += record.counts.long().cpu()
        self.dropped += int(record.dropped)
        ent, margin, n = confidence_sums(record)
        self.entropy_sum += ent
        self.margin_sum += margin
        self.num_tokens += n
        a = selection_matrix(record)
        self.coselect += a.T @ a
        m, p = adjacent_agreement_counts(record)
        self.adjacent_matches += m
        self.adjacent_pairs += p
        if domains is not None:
            self._add_domains(domain_expert_counts([record], [domains], self.num_domains))

    def _add_domains(self, counts: Tensor) -> None:
        # Without a fixed num_domains the table grows to the largest label seen so far.
        if self.domain_counts is None:
            self.domain_counts = counts
            return
        rows = max(self.domain_counts.shape[0], counts.shape[0])
        grown = torch.zeros(rows, self.num_experts, dtype=torch.long)
        grown[: self.domain_counts.shape[0]] += self.domain_counts
        grown[: counts.shape[0]] += counts
        self.domain_counts = grown

    def load(self) -> LoadStats:
        return load_stats_from_counts(self.counts, dropped=self.dropped)

    def confidence(self) -> ConfidenceStats:
        return confidence_from_sums(
            self.entropy_sum, self.margin_sum, self.num_tokens, self.num_experts
        )

    def coactivation(self) -> tuple[Tensor, Tensor]:
        """``(C [E, E] int64 with zero diagonal, n [E] int64)`` as :func:`coactivation_counts`."""
        return split_gram(self.coselect)

    def adjacent(self) -> Agreement:
        return Agreement(
            fraction=safe_div(self.adjacent_matches, self.adjacent_pairs),
            matches=self.adjacent_matches,
            pairs=self.adjacent_pairs,
        )

    def domains(self) -> DomainStats | None:
        """Domain × expert statistics, or None when no batch carried labels."""
        if self.domain_counts is None:
            return None
        return domain_stats_from_counts(self.domain_counts)


class RoutingAccumulator:
    """Streaming routing statistics of every MoE layer of a model, batch by batch.

    Args:
        num_domains: the number of domain labels, when known (labels must lie in
            ``[0, num_domains)``); otherwise the domain table grows to the largest label seen.

    Call :meth:`update` once per batch with the records of every MoE layer in layer order
    (the same tokens in every layer). Memory is ``O(L·E² + L·num_domains·E)``, independent of
    the number of tokens.
    """

    def __init__(self, num_domains: int | None = None) -> None:
        self.num_domains = num_domains
        self.layers: list[LayerAccumulator] = []
        self.transition_counts: list[Tensor] = []

    @property
    def num_batches(self) -> int:
        return self.layers[0].num_records if self.layers else 0

    def update(self, records: Sequence[RoutingRecord], domains: Tensor | None = None) -> None:
        """Add one batch.

        Args:
            records: ``[L]`` one RoutingRecord per MoE layer, all over the same T tokens.
            domains: optional ``[T]`` (or ``[B, S]``) integer domain label of every token.

        Raises:
            ValueError: when ``records`` is empty, its layer count or a layer's E differs from
                earlier batches, the layers disagree on T, or the labels do not match T or lie
                outside ``[0, num_domains)``. A rejected batch changes nothing.
            TypeError: when a record is not a RoutingRecord or the labels are not integers.
        """
        if len(records) == 0:
            raise ValueError("records must hold at least one RoutingRecord (one per MoE layer)")
        experts = [check_records([r], f"records[{i}]") for i, r in enumerate(records)]
        if not self.layers:
            self.layers = [LayerAccumulator(e, self.num_domains) for e in experts]
            self.transition_counts = [
                torch.zeros(a, b, dtype=torch.long) for a, b in itertools.pairwise(experts)
            ]
        elif experts != [lay.num_experts for lay in self.layers]:
            raise ValueError(
                f"batch {self.num_batches} has experts per layer {experts}, earlier batches "
                f"{[lay.num_experts for lay in self.layers]}"
            )
        T = records[0].probs.shape[0]
        for i, r in enumerate(records):
            if r.probs.shape[0] != T:
                raise ValueError(
                    f"batch {self.num_batches}: layer {i} saw T={r.probs.shape[0]} tokens but "
                    f"layer 0 saw T={T}"
                )
        if domains is not None:
            domains = as_long(domains, "domains").reshape(-1).cpu()
            if domains.numel() != T:
                raise ValueError(
                    f"batch {self.num_batches}: {domains.numel()} domain labels for T={T} tokens"
                )
            bound = self.num_domains
            if T and (domains.min() < 0 or (bound is not None and domains.max() >= bound)):
                raise ValueError(
                    f"batch {self.num_batches}: domain labels must lie in [0, {bound or 'inf'}), "
                    f"got [{int(domains.min())}, {int(domains.max())}]"
                )
        # Everything is validated above: a rejected batch leaves the sums untouched.
        for i, (ra, rb) in enumerate(itertools.pairwise(records)):
            mask = (ra.token_mask.bool() & rb.token_mask.bool()).cpu()
            self.transition_counts[i] += transition_counts_from_labels(
                ra.top1.cpu()[mask], rb.top1.cpu()[mask], experts[i], experts[i + 1]
            )
        for lay, r in zip(self.layers, records, strict=True):
            lay.update(r, domains)

    def transitions(self) -> list[Transition]:
        """Top-1 transitions between adjacent layers, as :func:`moelab.analysis.transitions`."""
        return [transition_from_counts(c, i, i + 1) for i, c in enumerate(self.transition_counts)]
