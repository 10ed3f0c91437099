"""TIME's CP experts: parameter count, score against a slow reference, gating."""

import torch
from torch import nn

from moelab.methods.editing.cp import CPEditBank, cp_parameter_count, cp_scores, square_factors
from moelab.methods.editing.layer import EditedLinear


def test_parameter_count_is_rank_times_the_sum_of_factor_dims():
    assert square_factors(1536) == (32, 48)
    assert cp_parameter_count(4, (32, 48, 576)) == 2624  # the spec's SmolLM2 figure
    bank = CPEditBank(88, 32, rank=3, factor_shape=None, threshold=0.4)
    bank.start(torch.randn(2, 88), nn.Linear(88, 32, bias=False))
    bank.commit()
    stored = sum(t[0].numel() for t in (bank.u, bank.v, bank.w))
    assert bank.params_per_edit == stored == 3 * (8 + 11 + 32)


def test_score_matches_a_loop_over_the_definition():
    torch.manual_seed(0)
    a, u, v = torch.randn(5, 12), torch.randn(2, 3), torch.randn(2, 4)
    want = []
    for row in a:
        h = row.reshape(3, 4)
        resp = torch.stack([u[r] @ h @ v[r] for r in range(2)])
        scale = max(float(u[r].norm() * v[r].norm()) for r in range(2))
        want.append(resp.norm() / (h.norm() * scale))
    assert torch.allclose(cp_scores(a, u, v), torch.stack(want), atol=1e-6)


def _one_edit_layer(threshold: float) -> tuple[nn.Linear, EditedLinear]:
    base = nn.Linear(6, 3, bias=False)
    bank = CPEditBank(6, 3, rank=1, factor_shape=(2, 3), threshold=threshold)
    bank.u = torch.tensor([[[1.0, 0.0]]])  # u = e1, v = e1: the score is |H[0,0]| / ‖H‖
    bank.v = torch.tensor([[[1.0, 0.0, 0.0]]])
    bank.w = torch.tensor([[[1.0, 2.0, 3.0]]])
    return base, EditedLinear(base, bank)


def test_below_threshold_the_output_is_bit_identical_and_above_it_adds_the_edit():
    base, layer = _one_edit_layer(threshold=0.5)
    silent = torch.tensor([[0.1, 2.0, -1.0, 0.5, 3.0, 1.0]])  # score 0.1/‖x‖ ≈ 0.026
    assert float(cp_scores(silent, layer.bank.u, layer.bank.v)) < 0.5
    assert torch.equal(layer(silent), base(silent))
    assert layer.last_routes.tolist() == [-1]
    loud = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # score 1, response u·H·v = 2
    assert torch.allclose(layer(loud), base(loud) + 2 * torch.tensor([1.0, 2.0, 3.0]))
    assert layer.last_routes.tolist() == [0] and layer.fire_counts.tolist() == [1]
