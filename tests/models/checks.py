"""Property checks shared by the model tests (vocabulary of 61 tokens)."""

import torch

VOCAB = 61


def assert_causal(model) -> None:
    """Changing the token at position t never changes logits before t, and does change them after."""
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20))
    with torch.no_grad():
        base = model(ids).logits
        for t in (0, 7, 19):
            changed = ids.clone()
            changed[:, t] = (changed[:, t] + 1 + torch.arange(3)) % VOCAB
            out = model(changed).logits
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
            # the change is visible from position t on (the check is not vacuous)
            assert (out[:, t:] - base[:, t:]).abs().amax() > 1e-3


def assert_kv_cache_matches_recomputation(model) -> None:
    """Prefill, a chunk, then one token at a time through the KV cache == one full forward."""
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_kv_cache(batch_size=2, max_len=24)
        pieces = [model(ids[:, :5], kv_cache=cache, start_pos=0).logits]
        assert cache.length == 5
        pieces.append(model(ids[:, 5:9], kv_cache=cache, start_pos=5).logits)
        for t in range(9, 17):
            pieces.append(model(ids[:, t : t + 1], kv_cache=cache, start_pos=t).logits)
        assert cache.length == 17
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert full.abs().amax() > 0.1
