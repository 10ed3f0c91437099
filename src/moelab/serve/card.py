"""The model card the server prints at start and returns under ``/v1/models``."""

from __future__ import annotations

from typing import Any

import torch

from moelab.models import MoETransformer, count_params


def model_card(model: MoETransformer, name: str) -> dict[str, Any]:
    """Name, parameter counts, shape and routing of ``model`` (JSON-serialisable; an
    offloaded model's counts include the experts in its store)."""
    cfg = model.cfg
    moe = [b for b in model.blocks if b.is_moe]
    router = moe[0].ffn.config.router if moe else None
    params = count_params(model)
    if getattr(model, "offload_engine", None) is not None:
        # the experts live in the store, not in the model: count the same model on meta
        with torch.device("meta"):
            params = count_params(MoETransformer(cfg))
    p = model.embed.weight
    return {
        "name": name,
        "params": params,
        "n_layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_seq_len,
        "objective": cfg.objective,
        **({"block_size": cfg.block_size} if cfg.objective == "block_diffusion" else {}),
        "moe_layers": [b.layer_idx for b in moe],
        "num_experts": router.num_experts if router else 0,
        "top_k": router.top_k if router else 0,
        "router": router.kind if router else None,
        "dtype": str(p.dtype).removeprefix("torch."),
        "device": str(p.device),
    }
