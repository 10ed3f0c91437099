"""GGUF reading without the real model: a tiny llama GGUF written with ``gguf.GGUFWriter``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.data.tokenizer import BPETokenizer, load_tokenizer
from moelab.interop.gguf import (
    build_gguf_tokenizer,
    config_from_gguf,
    load_gguf,
    read_gguf,
)
from moelab.interop.gguf_layout import permute_rope_rows, unpermute_rope_rows
from moelab.models.rope import apply_rope, rope_cos_sin

from .conftest import make_dense

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")


def test_unpermute_inverts_permute():
    w = torch.randn(6 * 8, 5)
    p = permute_rope_rows(w, 6)
    assert not torch.equal(p, w)
    assert torch.equal(unpermute_rope_rows(p, 6), w)
    with pytest.raises(ValueError, match="n_heads"):
        permute_rope_rows(torch.randn(10, 3), 3)


def _interleaved_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's "normal" RoPE: rotate adjacent pairs (x[2i], x[2i+1]) by pos·θ^(-2i/hd)."""
    S, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2)


def test_permuted_rows_with_interleaved_rope_match_rotate_half():
    """What llama.cpp computes on the GGUF rows equals moelab's RoPE on the un-permuted rows."""
    H, hd, D, S, theta = 3, 16, 24, 11, 1e5
    wq, wk = (
        torch.randn(H * hd, D, dtype=torch.float64),
        torch.randn(H * hd, D, dtype=torch.float64),
    )
    x = torch.randn(S, D, dtype=torch.float64)

    def heads(w):
        return (x @ w.T).view(S, H, hd).transpose(0, 1)  # [H, S, hd]

    q_cpp = _interleaved_rope(heads(permute_rope_rows(wq, H)), theta)
    k_cpp = _interleaved_rope(heads(permute_rope_rows(wk, H)), theta)
    cos, sin = rope_cos_sin(S, hd, theta)
    q = apply_rope(heads(wq), cos.double(), sin.double())
    k = apply_rope(heads(wk), cos.double(), sin.double())
    scores_cpp = q_cpp @ k_cpp.transpose(-1, -2)
    # moelab's apply_rope computes in float32, hence the tolerance
    torch.testing.assert_close(scores_cpp, q @ k.transpose(-1, -2), rtol=1e-4, atol=1e-4)
    # without the permutation the two conventions disagree (the test can fail)
    q_bad = _interleaved_rope(heads(wq), theta)
    k_bad = _interleaved_rope(heads(wk), theta)
    assert (q_bad @ k_bad.transpose(-1, -2) - scores_cpp).abs().max() > 1.0


def _tiny_tokenizer() -> BPETokenizer:
    texts = ["the cat sat on the mat 123", "a dog and 4567 cats", "the mat is flat"] * 20
    return BPETokenizer.train(texts, 300, min_frequency=2)


def _write_tiny_gguf(path, model, tok: BPETokenizer, pre: str = "gpt2") -> None:
    """A llama GGUF of ``model`` as llama.cpp's converter would write it (Q/K permuted)."""
    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.dense_ffn_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    hf = tok._tok
    vocab = hf.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = json.loads(hf.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["embed.weight"])
    w.add_tensor("output_norm.weight", sd["norm.weight"])
    if not cfg.tie_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        q = permute_rope_rows(torch.from_numpy(sd[p + "attn.q_proj.weight"]), cfg.n_heads)
        k = permute_rope_rows(torch.from_numpy(sd[p + "attn.k_proj.weight"]), cfg.n_kv_heads)
        for name, arr in [
            ("attn_norm", sd[p + "attn_norm.weight"]),
            ("attn_q", q.numpy()),
            ("attn_k", k.numpy()),
            ("attn_v", sd[p + "attn.v_proj.weight"]),
            ("attn_output", sd[p + "attn.o_proj.weight"]),
            ("ffn_norm", sd[p + "ffn_norm.weight"]),
            ("ffn_gate", sd[p + "ffn.w_gate.weight"]),
            ("ffn_up", sd[p + "ffn.w_up.weight"]),
            ("ffn_down", sd[p + "ffn.w_down.weight"]),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_gguf_round_trip(tmp_path, tie):
    tok = _tiny_tokenizer()
    model = make_dense(vocab_size=tok.vocab_size, tie=tie, seed=2, rope_theta=5e4, norm_eps=1e-6)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, tok)

    ckpt = read_gguf(path)
    cfg = config_from_gguf(ckpt)
    assert cfg.moe is None and cfg.tie_embeddings == tie
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.dense_ffn_size) == (4, 2, 48)
    assert cfg.rope_theta == 5e4 and cfg.norm_eps == pytest.approx(1e-6)

    loaded, gtok = load_gguf(path)
    ids = torch.randint(0, tok.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    assert loaded.lm_head.weight is loaded.embed.weight if tie else True

    text = "the cat and 4567 dogs sat"
    assert gtok.encode(text) == tok.encode(text)
    assert gtok.decode(gtok.encode(text)) == text
    gtok.save(tmp_path / "tok")
    assert load_tokenizer(tmp_path / "tok").encode(text) == tok.encode(text)


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    tok = _tiny_tokenizer()
    model = make_dense(vocab_size=tok.vocab_size, seed=2, n_layers=1)
    _write_tiny_gguf(tmp_path / "t.gguf", model, tok, pre="smollm")
    gtok = BPETokenizer(build_gguf_tokenizer(read_gguf(tmp_path / "t.gguf")))
    ids = gtok.encode("cats 4567")
    assert [gtok.decode([i]) for i in ids][-4:] == ["4", "5", "6", "7"]
    assert gtok.decode(ids) == "cats 4567"


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        read_gguf(bad)


def test_unsupported_tokenizer_and_arch(tmp_path):
    from moelab.interop.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(tmp_path / "x.gguf", {"tokenizer.ggml.model": "llama"}, {})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model"):
        build_gguf_tokenizer(ck)
    ck = GGUFCheckpoint(tmp_path / "x.gguf", {"general.architecture": "qwen2"}, {})
    with pytest.raises(ValueError, match=r"general\.architecture"):
        config_from_gguf(ck)


def test_default_pre_tokenizer_is_llama_cpp_four_regexes(tmp_path):
    """A missing or "default" ``tokenizer.ggml.pre`` is llama.cpp's default BPE split (runs of
    punctuation, then GPT-2's pattern, then digit runs, then groups of three digits), not
    GPT-2's pattern; the pieces below are worked out by hand from llama-vocab.cpp's regexes."""
    from moelab.interop.gguf import GGUFCheckpoint

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": []}  # fmt: skip
    text = "Hi, it's 12345 a+b"

    def pieces(**extra):
        ck = GGUFCheckpoint(tmp_path / "x.gguf", {**meta, **extra}, {})
        return [p for p, _ in build_gguf_tokenizer(ck).pre_tokenizer.pre_tokenize_str(text)]

    default = ["Hi", ",", "Ġit", "'", "s", "Ġ", "123", "45", "Ġa", "+", "b"]
    assert pieces() == pieces(**{"tokenizer.ggml.pre": "default"}) == default
    gpt2 = ["Hi", ",", "Ġit", "'s", "Ġ12345", "Ġa", "+", "b"]
    assert pieces(**{"tokenizer.ggml.pre": "gpt-2"}) == gpt2
