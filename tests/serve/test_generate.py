import pytest
import torch

from moelab.data import ByteTokenizer
from moelab.models import ModelConfig, MoETransformer
from moelab.serve.generate import generate_ids, stream_text
from moelab.serve.sampling import sample_next


def test_greedy_generation_equals_full_recomputation():
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=32)).eval()
    prompt = [3, 7, 1]
    got = list(generate_ids(model, prompt, max_new_tokens=10, temperature=0))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt) :]


def test_generation_stops_at_context_and_stop_id():
    model = MoETransformer(ModelConfig.tiny(vocab_size=50, max_seq_len=8)).eval()
    # 8 positions: 3 prompt + 5 fed back, and the token predicted at the last position
    assert len(list(generate_ids(model, [1, 2, 3], max_new_tokens=100, temperature=0))) == 6
    first = next(generate_ids(model, [1], max_new_tokens=1, temperature=0))
    assert list(generate_ids(model, [1], max_new_tokens=5, temperature=0, stop_id=first)) == []
    with pytest.raises(ValueError, match="prompt"):
        list(generate_ids(model, [], max_new_tokens=1))


def test_sampling_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=0).item() == 0
    assert all(sample_next(logits, top_k=1, generator=g).item() == 0 for _ in range(20))
    assert all(sample_next(logits, top_p=0.01, generator=g).item() == 0 for _ in range(20))
    # top-p = 0.9 keeps {0, 1, 2} (mass before token 2 is 0.85 < 0.9) and never samples 3
    draws = {sample_next(logits, top_p=0.9, generator=g).item() for _ in range(300)}
    assert draws == {0, 1, 2}
    draws = {sample_next(logits, top_k=2, generator=g).item() for _ in range(300)}
    assert draws == {0, 1}
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, top_p=1.5)


def test_stream_text_holds_back_partial_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    pieces = list(stream_text(tok, iter(ids)))
    assert "".join(pieces) == "héllo ✓"
    assert all("\ufffd" not in p for p in pieces)
