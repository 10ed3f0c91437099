"""A tiny random BERT encoder, a word-hash tokenizer and a synthetic stream for the continual
tests (no pretrained weights, no data files)."""

from __future__ import annotations

import zlib

import torch

from moelab.methods.continual.backbone import PrefixCache, check_adapted_blocks
from moelab.methods.continual.config import ContinualConfig
from moelab.methods.continual.data import synthetic_texts
from moelab.methods.continual.recipe import LEARNERS
from moelab.methods.continual.stream import class_incremental_stream
from moelab.models.encoder import BertEncoder
from moelab.models.encoder_config import BertConfig

VOCAB = 97


def tiny_encoder(seed: int = 0) -> BertEncoder:
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return BertEncoder(cfg).eval()


def tokenize(texts):
    """[CLS]=1, words hashed to [3, VOCAB), [SEP]=2, right-padded with 0."""
    rows = [
        [1, *[3 + zlib.crc32(w.encode()) % (VOCAB - 3) for w in t.split()][:12], 2] for t in texts
    ]
    S = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return ids, mask


TINY = dict(
    stream="synthetic",
    num_classes=6,
    num_tasks=3,
    classes_per_task=2,
    train_per_class=8,
    test_per_class=4,
    adapted_blocks=2,
    expert_dim=4,
    shared_dim=4,
    adapter_dim=4,
    first_task_epochs=2,
    epochs=2,
    batch_size=8,
    ca_epochs=1,
)


def tiny_learner(method: str = "care", seed: int = 0, encoder=None, **overrides):
    config = ContinualConfig(**{**TINY, "method": method, **overrides})
    encoder = encoder or tiny_encoder()
    data = synthetic_texts(config.num_classes, 14, seed=1)
    stream = class_incremental_stream(
        data,
        num_tasks=config.num_tasks,
        classes_per_task=config.classes_per_task,
        train_per_class=config.train_per_class,
        test_per_class=config.test_per_class,
        seed=seed,
    )
    cache = PrefixCache(encoder, tokenize, check_adapted_blocks(encoder, config.adapted_blocks))
    cache.add(stream.texts)
    torch.manual_seed(seed)
    return LEARNERS[method](config, stream, encoder, cache, seed)
