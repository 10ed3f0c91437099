"""Keeping a subset of a bank's experts (pruning, expert parallelism): every per-expert tensor
is cut, each parameter keeps its trainability and attributes, and the kept experts compute
exactly what they computed in the whole bank."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import ExpertsConfig
from moelab.core.experts import ExpertBank, QuantizedExpertBank, QuantSpec
from moelab.core.experts.select import check_selectable, expert_layout, take_experts


def _bank(**kw) -> ExpertBank:
    torch.manual_seed(0)
    cfg = ExpertsConfig(hidden_size=8, ffn_hidden_size=6, init_std=0.3, **kw)
    bank = ExpertBank(cfg, 5, backend="loop").double()
    with torch.no_grad():  # non-zero biases and adapters, so a lost one shows in the outputs
        for p in bank.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return bank


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"activation": "gelu"},
        {"bias": True, "activation": "swiglu_clamped"},
        {"lora_rank": 2},
        {"lora_rank": 3, "bias": True, "activation": "geglu"},
    ],
)
def test_selected_experts_compute_what_they_computed_in_the_whole_bank(kw):
    bank = _bank(**kw)
    keep = torch.tensor([4, 1, 2])
    sub = bank.select_experts(keep)
    assert sub.num_experts == 3 and sub.backend == "loop"
    names = [n for n, _ in bank.named_parameters()]
    assert [n for n, _ in sub.named_parameters()] == names
    for n, p in sub.named_parameters():
        assert torch.equal(p, getattr(bank, n)[keep]), n
        assert p.data_ptr() != getattr(bank, n).data_ptr()  # an independent copy
    x = torch.randn(7, 8, dtype=torch.float64)
    for j, e in enumerate(keep.tolist()):
        assert torch.allclose(sub.expert_output(x, j), bank.expert_output(x, e), atol=1e-12)
    rows = torch.randn(6, 8, dtype=torch.float64)
    counts = torch.tensor([2, 1, 3])
    ref = torch.cat(
        [
            bank.expert_output(r, e)
            for r, e in zip(rows.split([2, 1, 3]), keep.tolist(), strict=True)
        ]
    )
    assert torch.allclose(sub(rows, counts), ref, atol=1e-12)


def test_selection_keeps_each_parameters_trainability_and_attributes():
    bank = _bank(lora_rank=2, bias=True)
    for n, p in bank.named_parameters():  # what moelab.models.lora.freeze_all_but_lora does
        p.requires_grad_(n.startswith("lora_"))
    bank.w_down.no_decay = True
    sub = bank.select_experts(torch.tensor([0, 3]))
    assert {n: p.requires_grad for n, p in sub.named_parameters()} == {
        "w_gate_up": False, "w_down": False, "b_gate_up": False, "b_down": False,
        "lora_A_in": True, "lora_B_in": True, "lora_A_down": True, "lora_B_down": True,
    }  # fmt: skip
    assert sub.w_down.no_decay is True
    bank.eval()
    assert not bank.select_experts(torch.tensor([1])).training


def test_banks_that_cannot_lose_experts_are_refused_by_name():
    cfg = ExpertsConfig(hidden_size=8, ffn_hidden_size=8)
    q = QuantizedExpertBank(cfg, 4, QuantSpec(method="rtn", group_size=4))
    with pytest.raises(ValueError, match=r"pruning: layer 3 holds a QuantizedExpertBank"):
        check_selectable(q, "layer 3", "pruning")
    check_selectable(_bank(), "layer 0", "pruning")  # a full-precision bank can


class _Toy(torch.nn.Module):
    def __init__(self, E, odd_rows=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(3.0 * E).view(E, 3))
        self.shared = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("odd", torch.zeros(odd_rows(E) if odd_rows else E))


def test_layout_is_learned_from_the_module_kind_and_odd_tensors_are_refused():
    toy = _Toy(4)
    assert expert_layout(toy, 4, _Toy) == {"weight": True, "shared": False, "odd": True}
    sub = take_experts(toy, torch.tensor([3, 0]), 4, _Toy)
    assert sub.weight.tolist() == [[9.0, 10.0, 11.0], [0.0, 1.0, 2.0]]
    assert torch.equal(sub.shared, toy.shared) and sub.shared is not toy.shared
    doubled = lambda E: _Toy(E, lambda e: 2 * e)  # noqa: E731  two rows per expert
    with pytest.raises(ValueError, match=r"odd: grows from \(8,\) to \(10,\)"):
        take_experts(doubled(4), torch.tensor([0]), 4, doubled)
    with pytest.raises(ValueError, match=r"weight: shape \(4, 3\), but a fresh _Toy of 5"):
        expert_layout(toy, 5, _Toy)
