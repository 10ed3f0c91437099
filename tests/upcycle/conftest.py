from __future__ import annotations

import pytest
import torch

from moelab.models import ModelConfig, MoETransformer


def make_dense(*, ffn: int = 48, tie: bool = True, seed: int = 0, **kw) -> MoETransformer:
    """A tiny random dense model (init_std 0.1 so every FFN visibly moves the logits)."""
    base = dict(
        vocab_size=61,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=48,
        init_std=0.1,
        dense_ffn_size=ffn,
        tie_embeddings=tie,
        moe=None,
    )
    base.update(kw)
    torch.manual_seed(seed)
    return MoETransformer(ModelConfig(**base)).eval()


@pytest.fixture
def dense() -> MoETransformer:
    return make_dense()


@pytest.fixture
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 61, (3, 40), generator=g)
