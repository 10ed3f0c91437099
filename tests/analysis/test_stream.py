"""The streaming RoutingAccumulator: the list-based metrics' values in constant memory."""

import pytest
import torch

from moelab.analysis import (
    RoutingAccumulator,
    adjacent_consistency,
    coactivation_counts,
    confidence_stats,
    domain_stats,
    load_stats,
    summarize,
    transitions,
)


def _feed(records_by_layer, domains):
    labels = domains.split([r.probs.shape[0] for r in records_by_layer[0]])
    acc = RoutingAccumulator()
    for b, batch in enumerate(zip(*records_by_layer, strict=True)):
        acc.update(batch, labels[b])
    return acc


def test_accumulator_matches_the_list_based_metrics(make_synthetic_run):
    records, domains, _, _ = make_synthetic_run(num_layers=3, num_experts=4, seed=3)
    acc = _feed(records, domains)
    for lay, recs in zip(acc.layers, records, strict=True):
        assert lay.load().to_dict() == load_stats(recs).to_dict()
        assert lay.confidence().entropy == pytest.approx(confidence_stats(recs).entropy)
        assert lay.confidence().margin == pytest.approx(confidence_stats(recs).margin)
        C, n = lay.coactivation()
        C_ref, n_ref = coactivation_counts(recs)
        assert torch.equal(C, C_ref) and torch.equal(n, n_ref)
        assert lay.adjacent() == adjacent_consistency(recs)
        assert torch.equal(lay.domains().counts, domain_stats(recs, domains).counts)
    for got, ref in zip(acc.transitions(), transitions(records), strict=True):
        assert torch.equal(got.counts, ref.counts) and got.nmi == pytest.approx(ref.nmi)


def test_accumulator_state_does_not_grow_with_the_tokens(make_synthetic_run):
    """The state after 2 batches and after 40 batches has the same number of elements."""
    records, domains, _, _ = make_synthetic_run(num_layers=2)

    def state_numel(acc):
        tensors = acc.transition_counts + [
            t for lay in acc.layers for t in (lay.counts, lay.coselect, lay.domain_counts)
        ]
        return sum(t.numel() for t in tensors)

    small = _feed(records, domains)
    big = _feed([recs * 20 for recs in records], domains.repeat(20))
    assert big.num_batches == 20 * small.num_batches
    assert state_numel(big) == state_numel(small)
    assert torch.equal(big.layers[0].counts, 20 * small.layers[0].counts)
    # every ratio-type metric is unchanged by repeating the same batches
    ratios = ("cv", "entropy", "margin", "adjacent_consistency", "domain_nmi", "pathway_nmi_next")
    for hb, hs in zip(summarize(big)["headline"], summarize(small)["headline"], strict=True):
        for key in ratios:
            assert (hb[key] is None and hs[key] is None) or hb[key] == pytest.approx(hs[key])


def test_domain_table_grows_to_the_largest_label(make_one_hot):
    acc = RoutingAccumulator()
    acc.update([make_one_hot([0, 1], 2)], torch.tensor([0, 0]))
    acc.update([make_one_hot([1, 1], 2)], torch.tensor([2, 2]))
    assert acc.layers[0].domains().counts.tolist() == [[1, 1], [0, 0], [0, 2]]


def test_accumulator_errors(make_one_hot):
    acc = RoutingAccumulator(num_domains=2)
    with pytest.raises(ValueError, match="at least one RoutingRecord"):
        acc.update([])
    acc.update([make_one_hot([0, 1], 2), make_one_hot([1, 1], 2)], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="experts per layer"):
        acc.update([make_one_hot([0, 1], 2), make_one_hot([1, 1], 3)])
    with pytest.raises(ValueError, match="T=3 tokens"):
        acc.update([make_one_hot([0, 1], 2), make_one_hot([1, 1, 0], 2)])
    with pytest.raises(ValueError, match="3 domain labels"):
        acc.update([make_one_hot([0, 1], 2), make_one_hot([1, 1], 2)], torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\)"):
        acc.update([make_one_hot([0, 1], 2), make_one_hot([1, 1], 2)], torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="saw no batch"):
        summarize(RoutingAccumulator())
    # the rejected batches changed nothing
    assert acc.num_batches == 1 and acc.layers[1].counts.tolist() == [0, 2]
