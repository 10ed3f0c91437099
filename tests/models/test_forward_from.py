"""MoETransformer.hidden_at / forward_from: the cached-prefix forward equals the full one."""

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.models import ModelConfig, MoETransformer


@pytest.mark.parametrize("block", [0, 1, 3])
def test_forward_from_the_cache_equals_forward_bit_for_bit(block):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(n_layers=3, moe_layers=(1,))).eval()
    ids = torch.randint(0, 64, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False  # right padding
    full = model(ids, mask).logits
    cached = model.hidden_at(ids, mask, block=block)
    assert not cached.requires_grad
    assert torch.equal(model.forward_from(cached, mask, start_block=block), full)
    last = torch.tensor([6, 4])
    at = model.forward_from(cached, mask, start_block=block, logits_at=last)
    assert torch.equal(at, model(ids, mask, logits_at=last).logits)


def test_bad_blocks_and_shapes_are_refused():
    model = MoETransformer(ModelConfig.tiny(n_layers=2))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(InvalidValueError, match="block"):
        model.hidden_at(ids, block=3)
    with pytest.raises(InvalidValueError, match="start_block"):
        model.forward_from(torch.zeros(1, 3, 32), start_block=-1)
    with pytest.raises(InvalidValueError, match="hidden"):
        model.forward_from(torch.zeros(1, 3, 31), start_block=1)
    with pytest.raises(InvalidValueError, match="mask"):
        model.forward_from(torch.zeros(1, 3, 32), torch.ones(1, 4, dtype=torch.bool), start_block=1)
