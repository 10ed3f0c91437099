"""The KV cache is allocated small and grows as positions are written (issue 19)."""

from __future__ import annotations

import pytest
import torch

from moelab.models import KVCache

from .checks import VOCAB


def test_cache_grows_by_doubling_and_keeps_its_contents(model_factory):
    model = model_factory(n_kv_heads=2)
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 40))
    cache = model.new_kv_cache(2)
    assert cache.max_len == 48 and cache.capacity == 48  # min(max_len, initial 64)
    small = KVCache(2, 2, 2, 48, model.cfg.head_dim, initial_len=4)
    assert small.capacity == 4
    caps, pieces = [], []
    with torch.no_grad():
        full = model(ids).logits
        pieces.append(model(ids[:, :3], kv_cache=small).logits)
        caps.append(small.capacity)
        for t in range(3, 40):
            pieces.append(model(ids[:, t : t + 1], kv_cache=small, start_pos=t).logits)
            caps.append(small.capacity)
    assert sorted(set(caps)) == [4, 8, 16, 32, 48]  # doubling, capped at max_len
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_len=48"):
        small.reserve(49)


def test_per_row_start_pos_equals_each_row_alone(model_factory):
    """RoPE and the causal mask with an int64 [B] start_pos give each row what an int
    start_pos gives it alone (the mechanism continuous batching runs on)."""
    from moelab.models import causal_mask

    model = model_factory()
    rope = model.rope
    q = torch.randn(3, 4, 2, model.cfg.head_dim)
    k = torch.randn(3, 2, 2, model.cfg.head_dim)
    starts = torch.tensor([0, 5, 11])
    rq, rk = rope(q, k, starts)
    for b, s in enumerate(starts.tolist()):
        eq, ek = rope(q[b : b + 1], k[b : b + 1], s)
        assert torch.equal(rq[b : b + 1], eq) and torch.equal(rk[b : b + 1], ek)
    key_mask = torch.arange(14)[None] < (starts + 2)[:, None]
    m = causal_mask(2, starts, key_mask, q.device)
    assert m.shape == (3, 1, 2, 14)
    for b, s in enumerate(starts.tolist()):
        want = torch.arange(14)[None] <= (s + torch.arange(2))[:, None]
        assert torch.equal(m[b, 0], want)
    with pytest.raises(ValueError, match="max_seq_len"):
        rope(q, k, torch.tensor([0, 0, 47]))
