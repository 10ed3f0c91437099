"""attention_bias and qk_norm ("head" as Qwen3-MoE, "full" as OLMoE): maths, causality,
KV cache, save/load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelab.models import Attention, ModelConfig, MoETransformer, RMSNorm, load_model, save_model
from moelab.models.rope import RotaryEmbedding

from .checks import assert_causal, assert_kv_cache_matches_recomputation

OPTIONS = [
    dict(attention_bias=True),
    dict(qk_norm="head"),
    dict(qk_norm="full"),
    dict(attention_bias=True, qk_norm="head", n_kv_heads=2),
    dict(qk_norm="full", n_kv_heads=1),
]
IDS = ["bias", "head", "full", "bias-head-gqa", "full-mqa"]


def _randomised(seed: int = 0, **kw) -> MoETransformer:
    """A tiny model whose biases and norm weights are random too (not zeros/ones)."""
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=61, max_seq_len=48, init_std=0.1, **kw)
    model = MoETransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return model


def test_defaults_have_no_new_parameters():
    model = MoETransformer(ModelConfig.tiny())
    names = set(model.state_dict())
    assert not any("bias" in n or "q_norm" in n or "k_norm" in n for n in names if ".attn." in n)


def test_parameter_shapes():
    m = MoETransformer(ModelConfig.tiny(d_model=32, n_heads=4, n_kv_heads=2, qk_norm="full"))
    assert m.blocks[0].attn.q_norm.weight.shape == (32,)
    assert m.blocks[0].attn.k_norm.weight.shape == (16,)
    m = MoETransformer(ModelConfig.tiny(n_kv_heads=2, qk_norm="head", attention_bias=True))
    a = m.blocks[0].attn
    assert a.q_norm.weight.shape == a.k_norm.weight.shape == (8,)
    assert a.q_proj.bias.shape == (32,) and a.k_proj.bias.shape == (16,)
    assert a.o_proj.bias is None
    torch.testing.assert_close(a.q_proj.bias, torch.zeros(32))  # init: zero biases


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_qk_norm_maths_against_reference(qk_norm):
    torch.manual_seed(0)
    D, H, Hkv, hd = 24, 4, 2, 6
    rope = RotaryEmbedding(hd, 16)
    attn = Attention(D, H, Hkv, hd, rope, bias=True, qk_norm=qk_norm, norm_eps=1e-6)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(
                torch.randn_like(p) * 0.3
                + (1.0 if p.dim() == 1 and p is not attn.q_proj.bias else 0)
            )
    x = torch.randn(2, 5, D)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q, k = x @ attn.q_proj.weight.T + attn.q_proj.bias, x @ attn.k_proj.weight.T + attn.k_proj.bias
    v = x @ attn.v_proj.weight.T + attn.v_proj.bias
    if qk_norm == "full":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k, v = (t.view(2, 5, -1, hd) for t in (q, k, v))
    if qk_norm == "head":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = rope(q, k)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = ref.transpose(1, 2).reshape(2, 5, H * hd) @ attn.o_proj.weight.T
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", OPTIONS, ids=IDS)
def test_causality_holds(kw):
    assert_causal(_randomised(**kw))


@pytest.mark.parametrize("kw", OPTIONS, ids=IDS)
def test_kv_cache_matches_recomputation(kw):
    assert_kv_cache_matches_recomputation(_randomised(**kw))


@pytest.mark.parametrize("kw", OPTIONS[3:], ids=IDS[3:])
def test_save_load_round_trip(tmp_path, kw):
    model = _randomised(**kw)
    save_model(model, tmp_path / "m")
    back = load_model(tmp_path / "m")
    assert back.cfg == model.cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)


@pytest.mark.parametrize(
    "field,value", [("qk_norm", "rms"), ("attention_bias", 1), ("qk_norm", None)]
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig.tiny(**{field: value})


def test_rmsnorm_is_used():
    assert isinstance(
        MoETransformer(ModelConfig.tiny(qk_norm="head")).blocks[0].attn.q_norm, RMSNorm
    )


@pytest.mark.parametrize(("heads", "kv"), [(6, 2), (4, 1), (4, 4)])
def test_masked_gqa_equals_attention_over_repeated_kv_heads(heads, kv):
    """With a mask shared by the heads, the query heads of one K/V head attend as rows of
    that head (no K/V copies): the same output as repeating each K/V head per query head."""
    torch.manual_seed(heads + kv)
    hd, B, S, L = 8, 2, 3, 7
    attn = Attention(16, heads, kv, hd, RotaryEmbedding(hd, 32)).double()
    q = torch.randn(B, heads, S, hd, dtype=torch.float64)
    k, v = (torch.randn(B, kv, L, hd, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(B, 1, S, L) < 0.6
    mask[..., -1] = True  # every query sees at least one key
    rep = heads // kv
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
    )
    want = attn.o_proj(ref.transpose(1, 2).reshape(B, S, heads * hd))
    torch.testing.assert_close(attn.attend(q, k, v, mask), want, rtol=0, atol=1e-12)
