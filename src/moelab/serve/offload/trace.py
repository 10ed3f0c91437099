"""Routing traces for the cache planner and for Belady's bound.

- :func:`record_trace`: tokens per expert per (sequence, MoE layer), ``counts [P, L, E]`` —
  ZipMoE's planner input (the authors profile per-prompt, per-layer expert counts). With
  different expert counts per layer (a pruned model) ``E`` is the largest and a layer's
  columns past its own experts are zero.
- :func:`record_requests`: per MoE layer, the experts each forward call needs, in the order
  the offload engine requests them (ascending expert id per call) — the future Belady's
  policy reads; recorded from any model (in memory or offloaded) on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import Tensor

from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models.block_diffusion import block_causal_mask, diffusion_forward
from moelab.models.transformer import MoETransformer


def _moe_layers(model: MoETransformer) -> list[MoELayer]:
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise InvalidValueError("model: has no MoE layer")
    return layers


@torch.no_grad()
def record_trace(model: MoETransformer, sequences: Iterable[Tensor]) -> np.ndarray:
    """Route each ``[S]`` or ``[1, S]`` int64 token sequence through ``model`` (eval mode; a
    block-diffusion model sees the clean sequence under its block-causal mask).

    Returns:
        ``[P, L, E]`` int64: tokens routed to each expert, per sequence and MoE layer
        (``E`` = the largest layer's expert count; zeros past a smaller layer's experts).
    Raises:
        ValueError: no MoE layer, or no sequence given.
    """
    E = max(layer.experts.num_experts for layer in _moe_layers(model))
    model.eval()
    device = next(model.parameters()).device
    rows = []
    diffusion = model.cfg.objective == "block_diffusion"
    for seq in sequences:
        ids = seq.view(1, -1).to(device)
        if diffusion:  # clean text under the block-causal mask (no causal path to run)
            pos = torch.arange(ids.shape[1], device=device)
            mask = block_causal_mask(pos, pos, model.cfg.block_size)
            out = diffusion_forward(model, ids, pos, mask)
        else:
            out = model(ids)
        counts = [r.counts.cpu().numpy() for r in out.records if r is not None]
        rows.append(np.stack([np.pad(c, (0, E - c.shape[0])) for c in counts]))
    if not rows:
        raise InvalidValueError("sequences: need at least one sequence")
    return np.stack(rows).astype(np.int64)


def record_requests(model: MoETransformer, run: Callable[[], object]) -> list[list[int]]:
    """Call ``run()`` (e.g. a generation) and return, per MoE layer, every expert requested,
    in request order (each call's experts with at least one routed pair, ascending)."""
    layers = _moe_layers(model)
    seqs: list[list[int]] = [[] for _ in layers]

    def hook(i):
        def fn(module, args, output):
            counts = output.plan.counts().tolist()
            seqs[i].extend(e for e, c in enumerate(counts) if c)

        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seqs
