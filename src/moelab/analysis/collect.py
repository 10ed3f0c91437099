"""Run a model over validation text and gather what :func:`summarize` needs: streamed routing
statistics of every MoE layer (records are folded into running sums batch by batch, so memory
does not grow with the tokens analysed), a fixed-size sample of each layer's input
representations (for the effective rank) and every expert's output on part of that sample (for
expert redundancy)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.analysis.stream import RoutingAccumulator
from moelab.data import TokenStream, eval_batches, eval_coverage
from moelab.errors import InvalidValueError
from moelab.models import MoETransformer
from moelab.models.hooks import moe_layers, observe_moe_layers


@dataclass
class Collected:
    """Inputs of :func:`moelab.analysis.analyze` for one model.

    Attributes:
        routing: the streamed routing statistics of every MoE layer (every token once).
        domain_names: label ``d`` is ``domain_names[d]``.
        hidden_by_layer: ``[T_sample, D]`` float32 inputs of each MoE layer.
        expert_outputs_by_layer: ``[E, T_redundancy, D]`` float32 outputs of each expert on
            the first ``T_redundancy`` sampled tokens (None for a single-expert layer).
    """

    routing: RoutingAccumulator
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
    layers = moe_layers(model)
    if not layers:
        raise InvalidValueError("model: has no MoE layer to analyse")
    inputs: list[list[Tensor]] = [[] for _ in layers]
    domain_names = list(next(iter(streams.values())).domain_names)
    routing = RoutingAccumulator(len(domain_names))
    n_batches = sum(
        math.ceil(eval_coverage(s, seq_len, max_tokens).n_windows / batch_size)
        for s in streams.values()
    )
    per_batch = math.ceil(sample_tokens / max(n_batches, 1))
    samples: list[list[Tensor]] = [[] for _ in layers]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    observer = observe_moe_layers(model, lambda i, layer, x, out: inputs[i].append(x))
    try:
        with observer:
            for stream in streams.values():
                for batch in eval_batches(stream, batch_size, seq_len, max_tokens):
                    out = model(batch.input_ids.to(device))
                    records = [r for r in out.records if r is not None]
                    routing.update(records, batch.domains.flatten().cpu())
                    for i in range(len(records)):
                        x = inputs[i].pop()
                        x = x.reshape(-1, x.shape[-1])
                        step = max(1, x.shape[0] // per_batch)
                        samples[i].append(
                            x[::step][:per_batch].float().cpu().clone()
                        )  # no view of x
                    if on_batch is not None:
                        on_batch()
    finally:
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
    return Collected(routing, domain_names, hidden, expert_outputs)
