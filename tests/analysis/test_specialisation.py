import pytest
import torch

from moelab.analysis import domain_expert_counts, domain_stats


def test_domain_a_to_expert_0_and_b_to_expert_1_gives_nmi_one(make_one_hot):
    domains = torch.tensor([0, 1, 1, 0, 0, 1])
    rec = make_one_hot(domains, 3)  # domain d -> expert d, expert 2 unused
    s = domain_stats([rec], domains)
    assert s.counts.tolist() == [[3, 0, 0], [0, 3, 0]]
    torch.testing.assert_close(
        s.fraction, torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)
    )
    assert s.nmi == pytest.approx(1.0, abs=1e-12)


def test_independent_routing_gives_nmi_near_zero(make_one_hot):
    g = torch.Generator().manual_seed(1)
    domains = torch.randint(0, 3, (20000,), generator=g)
    experts = torch.randint(0, 4, (20000,), generator=g)
    s = domain_stats([make_one_hot(experts, 4)], domains)
    assert s.nmi < 0.005
    assert s.fraction.sum(1).tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_top2_pairs_padding_and_split_over_records(make_record):
    probs = torch.full((3, 3), 1 / 3)
    a = make_record(probs, pairs=[(0, 0), (0, 1), (1, 2), (1, 0), (2, 2)], mask=[1, 1, 0])
    b = make_record(probs[:2], pairs=[(0, 1), (1, 1)])
    dom_a, dom_b = torch.tensor([0, 1, 1]), torch.tensor([1, 0])
    expected = [[1, 2, 0], [1, 1, 1]]
    assert domain_expert_counts([a, b], torch.cat([dom_a, dom_b])).tolist() == expected
    assert domain_expert_counts([a, b], [dom_a, dom_b]).tolist() == expected
    wide = domain_expert_counts([a, b], [dom_a, dom_b], num_domains=3)
    assert wide.tolist() == [*expected, [0, 0, 0]]


def test_domain_label_errors(make_one_hot):
    rec = make_one_hot([0, 1], 2)
    with pytest.raises(ValueError, match="concatenated"):
        domain_stats([rec], torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        domain_stats([rec], torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="out of range"):
        domain_stats([rec], torch.tensor([0, 2]), num_domains=2)
    with pytest.raises(TypeError, match="integer"):
        domain_stats([rec], torch.tensor([0.0, 1.0]))
