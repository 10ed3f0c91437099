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
