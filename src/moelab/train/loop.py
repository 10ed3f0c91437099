"""The training loop behind ``moelab train``.

AdamW with decoupled weight decay on matrices, linear warmup + cosine decay, gradient clipping
and accumulation, the MoE layers' aux losses (already weighted by their coefficients), the
aux-loss-free bias update once per optimizer step, periodic validation, atomic checkpoints
(every N steps and on Ctrl-C) and exact resume, and data parallelism under ``torchrun``.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from moelab.core.layer import MoELayer
from moelab.core.routers import update_expert_bias
from moelab.data import (
    Tokenizer,
    TokenStream,
    load_corpus,
    load_tokenizer,
    make_tokenizer,
    sample_batch,
    split_documents,
)
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.block_diffusion import to_block_diffusion
from moelab.train.checkpoint import load_checkpoint, save_checkpoint
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.diffusion import batch_elbo_nats, diffusion_loss_terms
from moelab.train.distributed import DistInfo, barrier, init_distributed, shutdown
from moelab.train.evaluate import EvalResult, evaluate
from moelab.train.metrics import MetricsLog
from moelab.train.progress import TrainProgress
from moelab.train.schedule import lr_at
from moelab.utils.atomic import atomic_write_json
from moelab.utils.jsonfile import read_json

RUN_FILE = "run.json"


@dataclass
class TrainResult:
    """What a finished (or interrupted) run reports."""

    run_dir: Path
    step: int
    interrupted: bool
    final_eval: EvalResult | None
    train_loss: float
    elapsed_s: float


class _LossModule(nn.Module):
    """``forward`` = the LM loss, so DistributedDataParallel hooks the whole step."""

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, targets):
        if self.model.cfg.objective == "block_diffusion":  # x_0 = the window's targets
            nats, aux, records = diffusion_loss_terms(self.model, targets)
            ce = nats / targets.numel()
            return ce + aux, ce, aux, records
        out = self.model.loss(input_ids, targets)
        return out.loss, out.ce, out.aux_loss, out.output.records


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers in depth order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The ``run.json`` of a run folder: ``{"model": {...}, "train": {...}}``.

    Raises:
        ConfigError: missing, unreadable or malformed, naming the file.
    """
    path = Path(run_dir) / RUN_FILE
    info = read_json(path, ConfigError)
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("train"), dict)
        or not isinstance(info.get("model"), dict)
    ):
        raise ConfigError(f"{path}: expected an object with 'model' and 'train' sections")
    return info


def run_train_config(folder: Path) -> TrainConfig:
    """The training settings of a run folder, or the defaults for a bare model folder."""
    if not (Path(folder) / RUN_FILE).exists():
        return TrainConfig()
    return TrainConfig.from_dict(read_run_info(folder)["train"])


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: exists and is not a folder")
    if resume:
        if not (run_dir / RUN_FILE).exists():
            raise ConfigError(f"{run_dir}: no run to resume (missing {RUN_FILE})")
        if (run_dir / "model.safetensors").exists():
            raise ConfigError(
                f"{run_dir}: the run has already finished; start a new run with another --out"
            )
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(
            f"{run_dir}: run folder exists and is not empty; pass --resume or another --out"
        )


def prepare_data(
    cfg: TrainConfig, tokenizer: Tokenizer | None
) -> tuple[Tokenizer, TokenStream, dict[str, TokenStream]]:
    """Load and split the corpus, train the tokenizer if none is given, and encode the
    training stream plus one validation stream per domain."""
    docs = load_corpus(cfg.data, max_bytes_per_domain=cfg.max_bytes_per_domain)
    train_docs, val_docs = split_documents(docs, val_fraction=cfg.val_fraction, seed=cfg.seed)
    if tokenizer is None:
        texts = [d.text for d in train_docs]
        tokenizer = make_tokenizer(cfg.tokenizer, texts, vocab_size=cfg.bpe_vocab_size)
    names = sorted({d.domain for d in docs})
    train = TokenStream.from_documents(train_docs, tokenizer, domain_names=names, name="train")
    val = {
        name: TokenStream.from_documents(
            [d for d in val_docs if d.domain == name],
            tokenizer,
            domain_names=names,
            name=f"val/{name}",
        )
        for name in names
    }
    return tokenizer, train, val


def _eval_record(step: int, result: EvalResult) -> dict[str, Any]:
    rec = {
        "step": step,
        "split": "val",
        "loss": result.overall.loss,
        "bpb": result.overall.bits_per_byte,
        "perplexity": result.overall.perplexity,
    }
    for name, score in result.per_domain.items():
        rec[f"bpb/{name}"] = score.bits_per_byte
    return rec


class _StopFlag:
    """Ctrl-C sets a flag checked between optimizer steps; a second Ctrl-C aborts at once."""

    def __init__(self) -> None:
        self.stop = False
        self._previous = None

    def __enter__(self) -> _StopFlag:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def train(
    model_cfg: ModelConfig | None,
    cfg: TrainConfig | None,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
) -> TrainResult:
    """Train (or resume) a run in ``run_dir``.

    Args:
        model_cfg: model to build (``vocab_size`` is set from the tokenizer); ignored on
            resume or with ``cfg.init_from``.
        cfg: training settings; on resume the run's saved settings are used.
        run_dir: run folder (created; must be empty unless resuming).
        resume: continue from the latest checkpoint, exactly (same data order, RNG, optimizer).
        progress: show the rich progress bar (rank 0 only).
        stop_after: stop (as if interrupted, with a checkpoint) after this optimizer step;
            for tests of resume.
    Returns:
        :class:`TrainResult`.
    Raises:
        ConfigError, CorpusError, CheckpointError, TokenizerError: user errors, one-line messages.
    """
    run_dir = Path(run_dir)
    dist_info = init_distributed()
    try:
        return _train(model_cfg, cfg, run_dir, resume, progress, stop_after, dist_info)
    finally:
        shutdown(dist_info)


def _train(
    model_cfg, cfg, run_dir, resume, progress, stop_after, dist_info: DistInfo
) -> TrainResult:
    _check_run_dir(run_dir, resume)
    ckpt = None
    if resume:
        run_info = read_run_info(run_dir)
        cfg = TrainConfig.from_dict(run_info["train"])
        ckpt = load_checkpoint(run_dir)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(run_dir) if resume else None
    model: MoETransformer | None = None
    if ckpt is not None:
        model = ckpt.model
    elif cfg.init_from:
        model = load_model(Path(cfg.init_from))
        tokenizer = load_tokenizer(Path(cfg.init_from))
    tokenizer, train_stream, val_streams = prepare_data(cfg, tokenizer)
    if model is None:
        if resume:  # run.json exists but no checkpoint yet: start over from the saved config
            model_cfg = ModelConfig.from_dict(run_info["model"])
        model_cfg.vocab_size = tokenizer.vocab_size
        torch.manual_seed(cfg.seed)
        model = MoETransformer(model_cfg)
    if cfg.objective == "block-diffusion" and model.cfg.objective == "causal":
        model = to_block_diffusion(model, cfg.block_size)  # AR init (+1 mask id)
    elif cfg.objective == "causal" and model.cfg.objective != "causal":
        raise ConfigError(
            "objective: the model is a block-diffusion model; pass --objective block-diffusion"
        )
    extra = 1 if model.cfg.objective == "block_diffusion" else 0  # the mask id
    if model.cfg.vocab_size != tokenizer.vocab_size + extra:
        raise ConfigError(
            f"vocab_size: the model has {model.cfg.vocab_size} tokens, the tokenizer {tokenizer.vocab_size}"
        )
    if extra and model.cfg.block_size != cfg.block_size:
        raise ConfigError(
            f"block_size: the model uses {model.cfg.block_size}, the run {cfg.block_size}"
        )
    noncausal = model.noncausal_routing_layers()
    if noncausal and not cfg.allow_noncausal_routing:
        raise ConfigError(
            f"router: MoE layers {noncausal} route with a USMoE scope that looks at future "
            "tokens, so the model is not a causal LM; use --usmoe-scope position or "
            "causal_prefix, or pass --allow-noncausal-routing"
        )
    if model.cfg.max_seq_len < cfg.seq_len:
        raise ConfigError(
            f"seq_len: {cfg.seq_len} exceeds the model's max_seq_len={model.cfg.max_seq_len}"
        )
    if dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            tokenizer.save(run_dir)
            atomic_write_json(
                run_dir / RUN_FILE, {"model": model.cfg.to_dict(), "train": cfg.to_dict()}
            )
    barrier(dist_info)

    layers = moe_layers(model)
    module = _LossModule(model)
    step_fn = DDP(module) if dist_info.enabled else module
    optimizer = torch.optim.AdamW(
        _param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + dist_info.rank)
    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    if ckpt is not None:
        optimizer.load_state_dict(ckpt.state["optimizer"])
        torch.set_rng_state(ckpt.state["torch_rng"])
        generator.set_state(ckpt.state["generator"][dist_info.rank])
        start_step = ckpt.step
        tokens_seen = int(ckpt.state["tokens_seen"])
        elapsed_before = float(ckpt.state["elapsed_s"])
        if dist_info.is_main:
            metrics.truncate_after(start_step)
    elif resume and dist_info.is_main:
        metrics.truncate_after(0)

    def checkpoint(step: int) -> None:
        gens = [generator.get_state()]
        if dist_info.enabled:
            gens = [torch.empty_like(gens[0]) for _ in range(dist_info.world_size)]
            torch.distributed.all_gather(gens, generator.get_state())
        if dist_info.is_main:
            state = {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "generator": gens,
                "tokens_seen": tokens_seen,
                "elapsed_s": elapsed_before + time.perf_counter() - t0,
            }
            save_checkpoint(run_dir, model, state, step)
        barrier(dist_info)

    def validate(step: int) -> EvalResult | None:
        """Score the validation streams on rank 0 and log them."""
        result = None
        if dist_info.is_main:
            result = evaluate(
                model,
                val_streams,
                seq_len=cfg.seq_len,
                batch_size=cfg.batch_size,
                max_tokens=cfg.eval_tokens,
                nats_fn=batch_elbo_nats if model.cfg.objective == "block_diffusion" else None,
            )
            rec = _eval_record(step, result)
            metrics.write(rec)
            bar.set_val(result.overall.bits_per_byte)
        barrier(dist_info)
        return result

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * dist_info.world_size
    bar = TrainProgress(cfg.steps, enabled=progress and dist_info.is_main, start=start_step)
    model.train()
    t0 = time.perf_counter()
    step = start_step
    last_loss = math.nan
    interrupted = False
    final_eval: EvalResult | None = None
    with _StopFlag() as stop, bar:
        if start_step == 0:  # the starting point of the validation curve
            validate(0)
        while step < cfg.steps:
            lr = lr_at(
                step,
                lr=cfg.lr,
                warmup_steps=cfg.warmup_steps,
                total_steps=cfg.steps,
                min_lr_ratio=cfg.min_lr_ratio,
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            t_step = time.perf_counter()
            counts = [
                torch.zeros(layer.config.router.num_experts, dtype=torch.int64) for layer in layers
            ]
            ce_sum = aux_sum = 0.0
            n_bytes = 0
            for micro in range(cfg.grad_accum):
                batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, generator)
                sync = micro == cfg.grad_accum - 1 or not dist_info.enabled
                ctx = nullcontext() if sync else step_fn.no_sync()
                with ctx:
                    loss, ce, aux, records = step_fn(batch.input_ids, batch.targets)
                    (loss / cfg.grad_accum).backward()
                ce_sum += ce.item()
                aux_sum += aux.item()
                n_bytes += int(batch.target_bytes.sum())
                for c, rec in zip(counts, [r for r in records if r is not None], strict=True):
                    c += rec.counts
            if not math.isfinite(ce_sum):
                raise FloatingPointError(f"step {step}: training loss is not finite")
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
                if cfg.grad_clip > 0
                else math.nan
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for layer, c in zip(layers, counts, strict=True):
                if layer.router.config.expert_bias:
                    update_expert_bias(layer.router, c)
                layer.reset_loss_state()
            step += 1
            tokens_seen += tokens_per_step
            dt = time.perf_counter() - t_step
            last_loss = ce_sum / cfg.grad_accum
            tokens_local = cfg.batch_size * cfg.seq_len * cfg.grad_accum
            imbalance = [
                (c.max() / c.float().mean()).item() if c.sum() > 0 else 0.0 for c in counts
            ]
            bpb = (ce_sum / math.log(2)) * (tokens_local / cfg.grad_accum) / max(n_bytes, 1)
            bar.update(
                step,
                loss=last_loss,
                aux=aux_sum / cfg.grad_accum,
                tok_s=tokens_per_step / dt,
                imbalance=max(imbalance, default=0.0),
            )
            if dist_info.is_main and (step % cfg.log_every == 0 or step == cfg.steps):
                rec = {
                    "step": step,
                    "split": "train",
                    "loss": last_loss,
                    "bpb": bpb,
                    "aux_loss": aux_sum / cfg.grad_accum,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": tokens_seen,
                    "tokens_per_s": tokens_per_step / dt,
                    "load_imbalance": imbalance,
                    "load": [(c.float() / max(int(c.sum()), 1)).tolist() for c in counts],
                }
                metrics.write(rec)
            over_budget = cfg.time_budget_s is not None and (
                elapsed_before + time.perf_counter() - t0 >= cfg.time_budget_s
            )
            if step % cfg.eval_every == 0 or step == cfg.steps or over_budget:
                final_eval = validate(step) or final_eval
            stopping = stop.stop or (stop_after is not None and step >= stop_after) or over_budget
            if (
                stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            ) and step < cfg.steps:  # a finished run's result is the model at the run root
                checkpoint(step)
            if stopping:
                interrupted = stop.stop or (stop_after is not None and step >= stop_after)
                break
    if dist_info.is_main and not interrupted:
        save_model(model, run_dir)
    barrier(dist_info)
    return TrainResult(
        run_dir=run_dir,
        step=step,
        interrupted=interrupted,
        final_eval=final_eval,
        train_loss=last_loss,
        elapsed_s=elapsed_before + time.perf_counter() - t0,
    )
