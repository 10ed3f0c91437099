"""Presets: the default model and training settings of ``moelab train`` (learns visibly in ~7
minutes on 2 CPU cores), a smaller model for method benchmarks, and the config-merging rules
of ``--config`` and flags."""

from __future__ import annotations

from typing import Any

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.models import ModelConfig
from moelab.train.config import TrainConfig


def _byte_moe_lm(
    *,
    d_model: int,
    n_heads: int,
    experts: int,
    top_k: int,
    expert_ffn: int,
    context: int,
    losses: LossConfig,
) -> ModelConfig:
    """4 layers, 2 KV heads, byte vocabulary."""
    return ModelConfig(
        vocab_size=256,
        d_model=d_model,
        n_layers=4,
        n_heads=n_heads,
        n_kv_heads=2,
        max_seq_len=context,
        moe=MoEConfig(
            router=RouterConfig(num_experts=experts, top_k=top_k),
            experts=ExpertsConfig(hidden_size=d_model, ffn_hidden_size=expert_ffn),
            losses=losses,
        ),
    )


def default_model_config() -> ModelConfig:
    """4 layers, D=192, 16 experts of width 192, top-4, context 256; a byte vocabulary, which
    training replaces with its tokenizer's (``moelab train``: 512-token BPE).

    Fine-grained (DeepSeekMoE's expert segmentation, arXiv 2401.06066): the 8 experts of 384,
    top-2, of earlier versions split in halves, so the total (7.6M) and active (2.3M)
    parameters stay the same. At the ``make run`` budget it was ahead of that shape on each
    of 3 seeds and of the tuned dense twin by 0.060 ± 0.028 bits/byte
    (docs/benchmarks/moe-vs-dense.md)."""
    return _byte_moe_lm(
        d_model=192,
        n_heads=6,
        experts=16,
        top_k=4,
        expert_ffn=192,
        context=256,
        losses=LossConfig(load_balance="switch", aux_loss_coeff=1e-2, z_loss_coeff=1e-3),
    )


def small_model_config(losses: LossConfig | None = None) -> ModelConfig:
    """A smaller model for method benchmarks that train several runs (D=128, 8 experts of
    width 256, top-2, context 128)."""
    return _byte_moe_lm(
        d_model=128,
        n_heads=4,
        experts=8,
        top_k=2,
        expert_ffn=256,
        context=128,
        losses=losses or LossConfig(),
    )


def default_model_dict() -> dict[str, Any]:
    """The default model as a dict, with the fields derived from others (``head_dim``,
    ``dense_ffn_size``, ``norm_topk_prob``) left unset so they follow a changed ``d_model``/``n_heads``."""
    d = default_model_config().to_dict()
    d["head_dim"] = None
    d["dense_ffn_size"] = None
    d["moe"]["router"]["norm_topk_prob"] = None  # follows top_k (off for k = 1)
    return d


def default_train_dict() -> dict[str, Any]:
    """``moelab train``'s training defaults: :class:`TrainConfig`'s, with a byte-level BPE
    tokenizer of 512 tokens trained on the training split, on the whole corpus (no cap per
    domain: 20.7 MB of ``mix`` with Python 3.11's standard library).

    At ``make run``'s 380 s on 2 cores the BPE lowers the default MoE's validation bits/byte
    by about 0.25 against bytes and widens the MoE's lead over its dense twin, where 2,048
    tokens narrowed it. The library's 1.5 MB cap per domain (4.5 MB of ``mix``) is one epoch
    at about 380 s: at twice that and more, both models repeat it, the larger MoE overfits
    first and its lead shrinks (to −0.005 bits/byte at 3,040 s, one seed); on the whole
    corpus its lead at 380 s and 760 s is larger (docs/benchmarks/moe-vs-dense.md). The
    library's :class:`TrainConfig` keeps bytes and the cap, which cost no tokenizer training."""
    return TrainConfig().to_dict() | {
        "tokenizer": "bpe",
        "bpe_vocab_size": 512,
        "max_bytes_per_domain": None,
    }


def merge(
    base: dict[str, Any], override: dict[str, Any], *, skip_none: bool = False
) -> dict[str, Any]:
    """Recursive dict merge: ``override``'s leaves win. With ``skip_none`` a None in
    ``override`` means "not given" (CLI flags); otherwise it is a value (``moe: null``)."""
    out = dict(base)
    for key, value in override.items():
        if value is None and skip_none:
            continue
        if isinstance(value, dict):
            base_value = out.get(key)
            sub = merge(
                base_value if isinstance(base_value, dict) else {}, value, skip_none=skip_none
            )
            if sub or not skip_none or isinstance(base_value, dict):
                out[key] = sub
        else:
            out[key] = value
    return out
