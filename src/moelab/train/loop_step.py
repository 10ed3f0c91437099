"""One optimizer step of the training loop (:mod:`moelab.train.loop`): the loss module DDP
wraps, the gradient-accumulation micro-batches, the update (gradient sync, clipping, the
optimizer, the routers' bias updates) and the step's ``metrics.jsonl`` record."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moelab.core.latent_moe import BIAS_RATE_PER_LR, MultiHeadLatentMoE
from moelab.core.layer import MoELayer
from moelab.core.routers import update_expert_bias
from moelab.data import TokenStream, sample_batch
from moelab.models import MoETransformer
from moelab.train.config import TrainConfig
from moelab.train.diffusion import diffusion_loss_terms


class LossModule(nn.Module):
    """``forward`` = the LM loss, so DistributedDataParallel hooks the whole step."""

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, targets, doc_ids=None):
        if self.model.cfg.objective == "block_diffusion":  # x_0 = the window's targets
            nats, aux, records = diffusion_loss_terms(self.model, targets)
            ce = nats / targets.numel()
            return ce + aux, ce, aux, records
        out = self.model.loss(input_ids, targets, doc_ids=doc_ids)
        return out.loss, out.ce, out.aux_loss, out.output.records


def mixed_precision(cfg: TrainConfig, device: torch.device) -> AbstractContextManager:
    """The training forward's autocast context: bf16 for ``precision="bf16"``, else none."""
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _clip(model: nn.Module, max_norm: float) -> float:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()


@dataclass
class StepStats:
    """Sums over one step's micro-batches: cross-entropy and aux loss (nats per token, summed
    over micro-batches), target bytes, and tokens routed to each expert per MoE layer
    (``[E]`` int64 per layer)."""

    ce_sum: float
    aux_sum: float
    n_bytes: int
    counts: list[Tensor]


def accumulate_gradients(
    step_fn: nn.Module,
    module: nn.Module,
    layers: list[MoELayer],
    stream: TokenStream,
    cfg: TrainConfig,
    generator: torch.Generator,
    device: torch.device,
    stop_requested: Callable[[], bool],
    sample: Callable[..., Any] = sample_batch,
) -> StepStats:
    """Forward and backward ``cfg.grad_accum`` micro-batches (the loss divided by their
    number), DDP synchronising on the last one only; stops early, leaving a partial sum,
    as soon as ``stop_requested()`` (called once before every micro-batch) says so.
    ``sample`` draws a batch (:func:`moelab.data.sample_batch`'s signature; the loop passes
    its own module's name, which the fault-injection tests replace)."""
    counts = [
        torch.zeros(layer.config.router.num_experts, dtype=torch.int64, device=device)
        for layer in layers
    ]
    ce_sum = aux_sum = 0.0
    n_bytes = 0
    for micro in range(cfg.grad_accum):
        if stop_requested():  # react within one micro-batch: abandon this step
            break
        batch = sample(stream, cfg.batch_size, cfg.seq_len, generator)
        batch = batch.to(device, non_blocking=True)
        sync = micro == cfg.grad_accum - 1 or step_fn is module
        ctx = nullcontext() if sync else step_fn.no_sync()
        with ctx:
            doc_ids = batch.doc_ids if cfg.doc_masks else None
            with mixed_precision(cfg, batch.input_ids.device):
                loss, ce, aux, records = step_fn(batch.input_ids, batch.targets, doc_ids)
            (loss / cfg.grad_accum).backward()
        ce_sum += ce.item()
        aux_sum += aux.item()
        n_bytes += int(batch.target_bytes.sum())
        for layer in layers:
            layer.end_micro_batch()
        for c, rec in zip(counts, [r for r in records if r is not None], strict=True):
            c += rec.counts
    return StepStats(ce_sum, aux_sum, n_bytes, counts)


def apply_update(
    model: MoETransformer,
    optimizer: Any,
    layers: list[MoELayer],
    counts: list[Tensor],
    cfg: TrainConfig,
    parallel: Any,
) -> float:
    """Synchronise the gradients (``parallel``'s own sync; DDP has already reduced them),
    clip them to ``cfg.grad_clip`` (0 = off), take the optimizer step, and update the routers'
    aux-loss-free biases from ``counts`` (Multi-Head LatentMoE's at 50 × ``cfg.lr`` unless its
    config fixes the rate). Returns the pre-clip gradient norm (NaN when clipping is off)."""
    if parallel is not None:
        parallel.sync_gradients(model)
    clip = parallel.clip_grad_norm if parallel is not None else _clip
    grad_norm = clip(model, cfg.grad_clip) if cfg.grad_clip > 0 else math.nan
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for layer, c in zip(layers, counts, strict=True):
        if layer.router.config.expert_bias:
            update_expert_bias(layer.router, c)
        layer.reset_loss_state()
    for m in model.modules():
        if isinstance(m, MultiHeadLatentMoE):
            tied = m.config.bias_update_rate is None  # the authors' 50 × peak lr
            m.update_bias(BIAS_RATE_PER_LR * cfg.lr if tied else None)
    return grad_norm


def load_imbalance(counts: list[Tensor]) -> list[float]:
    """Per MoE layer, the busiest expert's tokens over the mean (0 for a layer with none)."""
    return [(c.max() / c.float().mean()).item() if c.sum() > 0 else 0.0 for c in counts]


def step_bpb(stats: StepStats, cfg: TrainConfig) -> float:
    """The step's training bits per byte on this rank's tokens."""
    tokens_local = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    return (stats.ce_sum / math.log(2)) * (tokens_local / cfg.grad_accum) / max(stats.n_bytes, 1)


def train_record(
    step: int,
    stats: StepStats,
    cfg: TrainConfig,
    *,
    lr: float,
    grad_norm: float,
    tokens: int,
    tokens_per_s: float,
) -> dict[str, Any]:
    """The ``split: "train"`` line of ``metrics.jsonl`` after optimizer step ``step``."""
    return {
        "step": step,
        "split": "train",
        "loss": stats.ce_sum / cfg.grad_accum,
        "bpb": step_bpb(stats, cfg),
        "aux_loss": stats.aux_sum / cfg.grad_accum,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens_per_s,
        "load_imbalance": load_imbalance(stats.counts),
        "load": [(c.float() / max(int(c.sum()), 1)).tolist() for c in stats.counts],
    }
