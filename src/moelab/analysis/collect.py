"""Run a model over validation text and gather what :func:`analyze` needs: every MoE layer's
RoutingRecords, per-token domain labels, a sample of each layer's input representations (for
the effective rank) and every expert's output on the same sample (for expert redundancy)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.core.layer import MoELayer
from moelab.core.telemetry import RoutingRecord
from moelab.data import TokenStream, eval_batches, eval_coverage
from moelab.errors import InvalidValueError
from moelab.models import MoETransformer


@dataclass
class Collected:
    """Inputs of :func:`moelab.analysis.analyze` for one model.

    Attributes:
        records_by_layer: ``[L_moe][batches]`` RoutingRecords (same batches in every layer).
        domains: per batch, ``[B·S]`` int64 domain label of every token.
        domain_names: label ``d`` is ``domain_names[d]``.
        hidden_by_layer: ``[T_sample, D]`` float32 inputs of each MoE layer.
        expert_outputs_by_layer: ``[E, T_redundancy, D]`` float32 outputs of each expert on
            the first ``T_redundancy`` sampled tokens (None for a single-expert layer).
    """

    records_by_layer: list[list[RoutingRecord]]
    domains: list[Tensor]
    domain_names: list[str]
    hidden_by_layer: list[Tensor]
    expert_outputs_by_layer: list[Tensor | None]


@torch.no_grad()
def collect(
    model: MoETransformer,
    streams: Mapping[str, TokenStream],
    *,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    sample_tokens: int = 2048,
    redundancy_tokens: int = 256,
    on_batch: Callable[[], None] | None = None,
) -> Collected:
    """Route up to ``max_tokens`` tokens of each stream through ``model`` (eval mode).

    Args:
        streams: named token streams, e.g. one validation stream per domain; the domain label
            of a token is its stream's domain id (``Batch.domains``).
        sample_tokens: tokens per layer kept for the effective rank (taken evenly from
            every batch).
        redundancy_tokens: tokens on which every expert is run for expert redundancy.
        on_batch: called after each batch (progress bars).
    Raises:
        ValueError: the model has no MoE layer, or a size argument is < 1.
    """
    for name, v in (
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("sample_tokens", sample_tokens),
    ):
        if v < 1:
            raise InvalidValueError(f"{name}: must be >= 1, got {v}")
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise InvalidValueError("model: has no MoE layer to analyse")
    inputs: list[list[Tensor]] = [[] for _ in layers]
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args, i=i: inputs[i].append(args[0].detach()))
        for i, layer in enumerate(layers)
    ]
    records: list[list[RoutingRecord]] = [[] for _ in layers]
    domains: list[Tensor] = []
    n_batches = sum(
        math.ceil(eval_coverage(s, seq_len, max_tokens).n_windows / batch_size)
        for s in streams.values()
    )
    per_batch = math.ceil(sample_tokens / max(n_batches, 1))
    samples: list[list[Tensor]] = [[] for _ in layers]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for stream in streams.values():
            for batch in eval_batches(stream, batch_size, seq_len, max_tokens):
                out = model(batch.input_ids.to(device))
                for i, rec in enumerate(r for r in out.records if r is not None):
                    records[i].append(rec)
                    x = inputs[i].pop()
                    x = x.reshape(-1, x.shape[-1])
                    step = max(1, x.shape[0] // per_batch)
                    samples[i].append(x[::step][:per_batch].float().cpu())
                domains.append(batch.domains.flatten().cpu())
                if on_batch is not None:
                    on_batch()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    hidden = [torch.cat(s)[:sample_tokens] for s in samples]
    expert_outputs: list[Tensor | None] = []
    for layer, h in zip(layers, hidden, strict=True):
        if layer.experts.num_experts < 2:  # redundancy compares pairs of experts
            expert_outputs.append(None)
            continue
        x = h[:redundancy_tokens].to(device=device, dtype=layer.experts.w_down.dtype)
        outs = [
            layer.experts.expert_output(x, e).float().cpu()
            for e in range(layer.experts.num_experts)
        ]
        expert_outputs.append(torch.stack(outs))
    return Collected(
        records, domains, list(next(iter(streams.values())).domain_names), hidden, expert_outputs
    )
