"""Packed sequences: documents packed into one row route and attend exactly as the same
documents run separately; the sequence-level balance loss is per document."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import LossConfig
from moelab.models import ModelConfig, MoETransformer
from moelab.models.packing import document_attention_mask, segment_ids


def _model():
    cfg = ModelConfig.tiny(vocab_size=50, n_layers=2, max_seq_len=32, init_std=0.1)
    cfg.moe.losses = LossConfig(load_balance="seq", aux_loss_coeff=1.0, z_loss_coeff=0.0)
    torch.manual_seed(0)
    return MoETransformer(cfg).eval()


def test_masks_and_segments_by_hand():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    m = document_attention_mask(doc, None)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert segment_ids(torch.tensor([[7, 7, 3, 3, 3], [1, 2, 2, 2, 5]])).tolist() == [
        0, 0, 2, 2, 2, 5, 6, 6, 6, 9,
    ]  # fmt: skip


def test_packed_documents_equal_separate_runs():
    model = _model()
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(0, 50, (1, n), generator=g) for n in (6, 4, 5))
    packed = torch.cat([a, b, c], dim=1)
    doc = torch.tensor([[0] * 6 + [1] * 4 + [2] * 5])
    with torch.enable_grad():
        out = model(packed, doc_ids=doc)
        alone = [model(x) for x in (a, b, c)]
    want = torch.cat([o.logits for o in alone], dim=1)
    assert (out.logits - want).abs().max() < 1e-5
    # without document masks the later documents see the earlier ones
    assert (model(packed).logits - want).abs().max() > 1e-3
    # sequence-level balance loss: the mean of the three documents' own losses
    per_doc = torch.stack([o.aux_losses["load_balance"] for o in alone]).mean()
    assert out.aux_losses["load_balance"].item() == pytest.approx(per_doc.item(), rel=1e-5)


def test_doc_ids_are_checked():
    model = _model()
    ids = torch.randint(0, 50, (1, 5))
    with pytest.raises(ValueError, match="doc_ids"):
        model(ids, doc_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="kv_cache"):
        model(ids, doc_ids=torch.zeros(1, 5, dtype=torch.long), kv_cache=model.new_kv_cache(1))


def test_streams_know_their_documents_and_a_doc_masked_run_trains(tmp_path):
    from moelab.data import ByteTokenizer, Document, TokenStream, eval_batches
    from moelab.train.config import TrainConfig
    from moelab.train.evaluate import evaluate
    from moelab.train.loop import train

    docs = [Document(name=f"doc{n}", domain="d", text="ab" * n) for n in (3, 1, 4)]
    stream = TokenStream.from_documents(docs, ByteTokenizer())
    assert stream.doc_index.tolist() == [0] * 7 + [1] * 3 + [2] * 9  # text + "\n" separator
    first = next(iter(eval_batches(stream, 2, 6)))  # windows start at 0 and 6
    assert first.doc_ids.tolist() == [
        stream.doc_index[0:6].tolist(),
        stream.doc_index[6:12].tolist(),
    ]
    # windows that cross documents score differently with document masks
    long_docs = [Document(name=str(n), domain="d", text="hello world " * (n + 2)) for n in range(4)]
    s = TokenStream.from_documents(long_docs, ByteTokenizer())
    torch.manual_seed(0)
    small = MoETransformer(ModelConfig.tiny(vocab_size=256, max_seq_len=32)).eval()
    masked = evaluate(small, {"d": s}, seq_len=32, batch_size=2, doc_masks=True)
    plain = evaluate(small, {"d": s}, seq_len=32, batch_size=2)
    assert masked.overall.loss != pytest.approx(plain.overall.loss, rel=1e-6)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"d{i}.txt").write_text("To be or not to be. " * (20 + i))
    cfg = TrainConfig(
        data=str(folder), max_bytes_per_domain=None, val_fraction=0.25, seq_len=16, batch_size=2,
        steps=2, warmup_steps=1, eval_every=2, eval_tokens=32, checkpoint_every=0, doc_masks=True,
    )  # fmt: skip
    model_cfg = ModelConfig.tiny(vocab_size=256, max_seq_len=16)
    result = train(model_cfg, cfg, tmp_path / "r", progress=False)
    assert result.step == 2 and result.final_eval is not None
