import math

import pytest
import torch

from moelab.analysis.cka import layer_cka, linear_cka
from moelab.errors import InvalidValueError


def test_cka_of_a_matrix_with_itself_is_one():
    x = torch.randn(20, 6, generator=torch.Generator().manual_seed(0))
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-6)


def test_cka_is_invariant_to_orthogonal_maps_and_isotropic_scaling():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 5, generator=g), torch.randn(30, 7, generator=g)
    q, _ = torch.linalg.qr(torch.randn(7, 7, generator=g))
    ref = float(linear_cka(x, y))
    assert 0.0 < ref < 1.0
    assert float(linear_cka(x, y @ q)) == pytest.approx(ref, rel=1e-5)
    assert float(linear_cka(3.5 * x, 0.1 * y)) == pytest.approx(ref, rel=1e-5)
    assert float(linear_cka(x + 4.0, y)) == pytest.approx(ref, rel=1e-5)  # column-centred
    # ...but not to an arbitrary invertible map
    a = torch.diag(torch.tensor([10.0, 1.0, 1.0, 1.0, 1.0]))
    assert abs(float(linear_cka(x @ a, y)) - ref) > 1e-3


def test_cka_matches_a_hand_computed_example():
    # centred X = [[2,-1],[-1,2],[-1,-1]]/3, Xᵀ X = [[2,-1],[-1,2]]/3, ‖·‖_F = √10/3;
    # centred y = [-1, 0, 1]: yᵀX = [-1, 0], ‖·‖² = 1; yᵀy = 2 → CKA = 1 / (2·√10/3)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    y = torch.tensor([[1.0], [2.0], [3.0]])
    assert float(linear_cka(x, y)) == pytest.approx(3 / (2 * math.sqrt(10)), rel=1e-6)
    # one column each: the squared Pearson correlation (here 0.5² = 0.25)
    assert float(linear_cka(y, torch.tensor([[1.0], [0.0], [2.0]]))) == pytest.approx(0.25)


def test_cka_is_differentiable_and_checks_shapes():
    x = torch.randn(8, 3, requires_grad=True)
    (1 - linear_cka(x, torch.randn(8, 4))).backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    with pytest.raises(InvalidValueError, match="same n"):
        linear_cka(torch.randn(5, 2), torch.randn(6, 2))
    with pytest.raises(InvalidValueError, match="same n"):
        linear_cka(torch.randn(1, 2), torch.randn(1, 2))
    assert layer_cka([x.detach()], [x.detach()]) == [pytest.approx(1.0, abs=1e-6)]
