"""The training loop behind ``moelab train``.

AdamW with decoupled weight decay on matrices, linear warmup + cosine decay, gradient clipping
and accumulation, the MoE layers' aux losses (already weighted by their coefficients), the
aux-loss-free bias update once per optimizer step, periodic validation, atomic checkpoints
(every N steps and on Ctrl-C) and exact resume, and data parallelism under ``torchrun``.

Reliability (what a kill, a second process or a changed input can and cannot do):

- The run folder is locked (:func:`moelab.utils.locking.folder_lock`) for the whole run: a
  second ``train``/``--resume`` on it is refused.
- SIGINT and SIGTERM set a stop flag checked before every micro-batch: a stop in the middle
  of a gradient-accumulation step abandons that step (the batch sampler's and torch's RNG
  states are rolled back to the step's start), writes a checkpoint of the last finished
  step and exits; resuming reproduces the uninterrupted run bit for bit. A second signal
  aborts at once (the last checkpoint stays valid).
- Distributed runs (:mod:`moelab.train.distributed`): every collective has a timeout
  (``dist_timeout_s``), so a stopped or hung rank ends its peers with one line
  (:class:`~moelab.errors.DistributedTimeoutError`) instead of holding them; rank 0's work
  alone is waited for through its heartbeat (:mod:`moelab.train.main_rank`), which does not
  count against the timeout; a rank blocked in a collective when SIGINT/SIGTERM arrives exits
  ``stop_grace_s`` seconds later (:mod:`moelab.train.stopping`).
- Finishing writes a checkpoint of the final step, then the model at the run root with the
  manifest last (covering the tokenizer files too): a run is finished exactly when
  ``RUN/manifest.json`` exists. A kill during the finish leaves an unfinished run that
  ``--resume`` completes from that checkpoint.
- ``run.json`` records a fingerprint of the corpus and of the tokenizer files; ``--resume``
  refuses a changed corpus or tokenizer unless ``allow_data_change=True``.
- With ``fit_to_budget`` the total steps are fitted to the time budget after the warmup and
  refitted after every validation (:mod:`moelab.train.budget`); each fit is written into
  ``run.json`` before the next step, so a resume replays the fitted schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from moelab.core.experts import cpu_kernel
from moelab.core.latent_moe import MultiHeadLatentMoE
from moelab.core.routers import update_expert_bias
from moelab.data import (
    Document,
    Tokenizer,
    TokenStream,
    load_corpus,
    load_tokenizer,
    make_tokenizer,
    sample_batch,
    split_documents,
)
from moelab.data.fingerprint import (
    corpus_fingerprint,
    describe_change,
    tokenizer_files,
    tokenizer_fingerprint,
)
from moelab.errors import TrainingDivergedError
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.block_diffusion import to_block_diffusion
from moelab.models.hooks import moe_layers
from moelab.models.io import MANIFEST_FILE
from moelab.models.lora import add_expert_lora, freeze_all_but_lora
from moelab.train.budget import (
    MIN_TIMED_STEPS,
    SKIP_STEPS,
    fit_step,
    fit_steps,
    progress_at,
    recorded_fits,
)
from moelab.train.checkpoint import checkpoint_dirs, load_checkpoint, save_checkpoint
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.device import device_rng_state, resolve_device, set_device_rng_state
from moelab.train.diffusion import batch_elbo_nats, diffusion_loss_terms
from moelab.train.distributed import (
    DEFAULT_DIST_TIMEOUT_S,
    DistInfo,
    barrier,
    init_distributed,
    shutdown,
    timeout_error,
)
from moelab.train.evaluate import EvalResult, evaluate
from moelab.train.expand import (
    ExpandSpec,
    check_expansion,
    expand_in_training,
    expansion_record,
)
from moelab.train.main_rank import MainRankWork
from moelab.train.metrics import MetricsLog
from moelab.train.optim import PlainAdamW, build_optimizer
from moelab.train.progress import TrainProgress
from moelab.train.schedule import scheduled_lr
from moelab.train.stopping import DEFAULT_STOP_GRACE_S, StopFlag, check_stop_grace
from moelab.utils.atomic import atomic_write_json
from moelab.utils.jsonfile import read_json
from moelab.utils.locking import folder_lock

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


def run_train_config(folder: Path, *, need_data: bool = False) -> TrainConfig:
    """The training settings of a run folder, or the defaults for a bare model folder.

    Args:
        folder: a run folder or a bare model folder.
        need_data: the caller will use the settings' corpus (the run's validation split): a
            folder without ``run.json`` then raises instead of silently using the default
            corpus.
    Raises:
        ConfigError: ``run.json`` is malformed, or missing while ``need_data``.
    """
    if not (Path(folder) / RUN_FILE).exists():
        if need_data:
            raise ConfigError(
                f"{folder}: no {RUN_FILE}, so the run's corpus is unknown; pass --data CORPUS"
            )
        return TrainConfig()
    return TrainConfig.from_dict(read_run_info(folder)["train"])


def run_finished(run_dir: str | Path) -> bool:
    """True when the run in ``run_dir`` finished: its final model's manifest (written last)
    exists at the run root."""
    return (Path(run_dir) / MANIFEST_FILE).is_file()


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: exists and is not a folder")
    if resume:
        if not (run_dir / RUN_FILE).exists():
            raise ConfigError(f"{run_dir}: no run to resume (missing {RUN_FILE})")
        if run_finished(run_dir):
            raise ConfigError(
                f"{run_dir}: the run has already finished; start a new run with another --out"
            )
    elif run_dir.exists() and any(not _start_leftover(p) for p in run_dir.iterdir()):
        raise ConfigError(
            f"{run_dir}: run folder exists and is not empty; pass --resume or another --out"
        )


def _start_leftover(path: Path) -> bool:
    """A file a start writes before ``run.json`` (the tokenizer, temp files): a run killed
    then left only these, which the next start rewrites, so they do not block it."""
    name = path.name
    return path.is_file() and (
        name in tokenizer_files(path.parent) or (name.startswith(".") and name.endswith(".tmp"))
    )


def prepare_data(
    cfg: TrainConfig, tokenizer: Tokenizer | None, docs: list[Document] | None = None
) -> tuple[Tokenizer, TokenStream, dict[str, TokenStream]]:
    """Load (unless ``docs`` are given) and split the corpus, train the tokenizer if none is
    given, and encode the training stream plus one validation stream per domain."""
    train_docs, val_docs, names = split_run_documents(cfg, docs)
    if tokenizer is None:
        texts = [d.text for d in train_docs]
        tokenizer = make_tokenizer(cfg.tokenizer, texts, vocab_size=cfg.bpe_vocab_size)
    train = TokenStream.from_documents(train_docs, tokenizer, domain_names=names, name="train")
    return tokenizer, train, domain_streams(val_docs, names, tokenizer)


def validation_streams(cfg: TrainConfig, tokenizer: Tokenizer) -> dict[str, TokenStream]:
    """The run's validation streams per domain (:func:`prepare_data`'s third result) without
    encoding the training split: what ``moelab eval`` and ``analyze`` score."""
    _, val_docs, names = split_run_documents(cfg)
    return domain_streams(val_docs, names, tokenizer)


def split_run_documents(
    cfg: TrainConfig, docs: list[Document] | None = None
) -> tuple[list[Document], list[Document], list[str]]:
    """(training documents, validation documents, sorted domain names) of the run's corpus
    (``docs``, or the corpus ``cfg`` names)."""
    if docs is None:
        docs = load_corpus(cfg.data, max_bytes_per_domain=cfg.max_bytes_per_domain)
    train_docs, val_docs = split_documents(docs, val_fraction=cfg.val_fraction, seed=cfg.seed)
    return train_docs, val_docs, sorted({d.domain for d in docs})


def domain_streams(val_docs, names, tokenizer) -> dict[str, TokenStream]:
    """One validation stream per domain in ``names`` (``val/{domain}``) of ``val_docs``."""
    return {
        name: TokenStream.from_documents(
            [d for d in val_docs if d.domain == name],
            tokenizer,
            domain_names=names,
            name=f"val/{name}",
        )
        for name in names
    }


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


def train(
    model_cfg: ModelConfig | None,
    cfg: TrainConfig | None,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    allow_data_change: bool = False,
    parallel: Any = None,
    on_step: Callable[[int, MoETransformer], dict[str, Any] | None] | None = None,
    device: str | torch.device | None = "auto",
    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
    stop_grace_s: float = DEFAULT_STOP_GRACE_S,
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
        allow_data_change: resume even though the corpus or tokenizer differs from the one
            recorded in ``run.json`` (the run then continues on the new data).
        parallel: an expert-parallel plan (:class:`moelab.parallel.ExpertParallel`: its
            ``prepare``, ``sync_gradients``, ``clip_grad_norm``, ``save_checkpoint``,
            ``check_resume``, ``load_checkpoint`` and ``save_model`` replace DDP, clipping and
            the checkpoint files; every rank validates and writes collectively). None = DDP.
        on_step: called as ``on_step(step, model)`` on rank 0 after every optimizer step
            (``step`` counts the updates so far), after that step's training record; a dict
            it returns is logged as ``{"step": step, "split": "probe", **dict}`` in
            ``metrics.jsonl`` (so ``--resume`` keeps exactly the records of the steps
            kept). For measurements such as a probe-batch loss curve: it must not change the
            model, and with ``parallel`` it must not run the sharded model's forward.
        device: ``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:N``
            (:func:`moelab.train.device.resolve_device`; under torchrun each rank takes
            ``cuda:$LOCAL_RANK``). Not part of the run's settings: a resume may change it.
        dist_timeout_s: distributed runs: the limit of every collective, and of the wait for
            a silent rank 0 (:mod:`moelab.train.distributed`). Not a run setting either.
        stop_grace_s: distributed runs: after SIGINT/SIGTERM, a rank whose main thread makes
            no progress for this long (blocked in a collective) exits with code 128 + the
            signal (:mod:`moelab.train.stopping`). Not a run setting either.
    Returns:
        :class:`TrainResult`.
    Raises:
        ConfigError, CorpusError, CheckpointError, TokenizerError: user errors, one-line messages
            (a ``device`` torch cannot use is a ConfigError).
        FolderBusyError: another process is writing into ``run_dir``.
        DiskFullError: the disk filled up (the last complete checkpoint stays valid).
        DistributedTimeoutError: another rank did not answer within ``dist_timeout_s``.
        InvalidValueError: ``dist_timeout_s`` or ``stop_grace_s`` is not a finite number > 0.
    """
    run_dir = Path(run_dir)
    check_stop_grace(stop_grace_s)
    device = resolve_device(device)
    dist_info = init_distributed(device, dist_timeout_s)
    args = (model_cfg, cfg, run_dir, resume, progress, stop_after, allow_data_change, dist_info)
    args = (*args, parallel, on_step, device, stop_grace_s)
    try:
        if not dist_info.is_main:
            return _train(*args)
        _check_run_dir(run_dir, resume)
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            with folder_lock(run_dir, what="run folder"):
                _check_run_dir(run_dir, resume)  # again: another process may have started
                return _train(*args)
        except BaseException:
            if created and not any(run_dir.iterdir()):
                run_dir.rmdir()
            raise
    except RuntimeError as exc:  # a collective's timeout is one line, not a traceback
        if (err := timeout_error(exc, dist_info)) is not None:
            raise err from exc
        raise
    finally:
        shutdown(dist_info)


def _check_same_data(run_dir: Path, run_info: dict[str, Any], fp: dict[str, Any]) -> None:
    """Refuse a resume whose corpus or tokenizer files differ from those in run.json."""
    old = run_info.get("data_fingerprint")
    if isinstance(old, dict) and old.get("sha256") != fp["sha256"]:
        raise ConfigError(
            f"{run_dir / RUN_FILE}: the corpus changed since the run started "
            f"({describe_change(old, fp)}); restore it, start a new run, or pass "
            "--allow-data-change to continue on the new data"
        )
    old_tok = run_info.get("tokenizer_sha256")
    if isinstance(old_tok, dict) and old_tok != tokenizer_fingerprint(run_dir):
        changed = sorted(
            n
            for n in {*old_tok, *tokenizer_fingerprint(run_dir)}
            if old_tok.get(n) != tokenizer_fingerprint(run_dir).get(n)
        )
        raise ConfigError(
            f"{run_dir}: tokenizer file(s) {', '.join(changed)} changed since the run started; "
            "restore them or start a new run"
        )


def _validation_from(step: int, cfg) -> int:
    """The first validation step at or after ``step`` (refits follow validations: a function
    of the step alone, so that a resume refits where the uninterrupted run did)."""
    return -(-step // cfg.eval_every) * cfg.eval_every


def _fit_to_budget(cfg, run_dir, dist_info, device, step, elapsed_s, step_times, last_s, fits):
    """``cfg`` with its steps fitted to its time budget (:func:`moelab.train.budget.fit_steps`;
    the least over the ranks); the fit is appended to ``fits`` and every fit recorded in
    run.json for ``--resume``."""
    requested = fits[0].requested_steps if fits else cfg.steps
    fit = fit_steps(
        step=step,
        elapsed_s=elapsed_s,
        budget_s=cfg.time_budget_s,
        max_steps=requested,
        step_times=step_times,
        eval_every=cfg.eval_every,
        eval_s=last_s["eval"],
        checkpoint_every=cfg.checkpoint_every,
        checkpoint_s=last_s["checkpoint"],
        progress=progress_at(
            step, warmup_steps=cfg.warmup_steps, requested_steps=requested, fits=fits
        ),
    )
    if dist_info.enabled:
        steps = torch.tensor([fit.steps], device=device)
        torch.distributed.all_reduce(steps, op=torch.distributed.ReduceOp.MIN)
        fit = dataclasses.replace(fit, steps=int(steps.item()))
    fits.append(fit)
    cfg = dataclasses.replace(cfg, steps=fit.steps)
    if dist_info.is_main:
        info = read_run_info(run_dir)
        info.pop("budget_fit", None)  # the single fit of runs from before refits
        info["train"] = cfg.to_dict()
        info["budget_fits"] = [f.to_dict() for f in fits]
        atomic_write_json(run_dir / RUN_FILE, info)
    barrier(dist_info)
    return cfg


def _train(
    model_cfg,
    cfg,
    run_dir,
    resume,
    progress,
    stop_after,
    allow_data_change,
    dist_info: DistInfo,
    parallel,
    on_step,
    device: torch.device,
    stop_grace_s: float,
) -> TrainResult:
    ckpt = None
    if resume:
        run_info = read_run_info(run_dir)
        cfg = TrainConfig.from_dict(run_info["train"])
        ckpt = load_checkpoint(run_dir) if parallel is None else None
        if parallel is None and ckpt is None and checkpoint_dirs(run_dir):
            raise ConfigError(f"{run_dir}: no checkpoint could be loaded")
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(run_dir) if resume else None
    model: MoETransformer | None = None
    if ckpt is not None:
        model = ckpt.model
    elif cfg.init_from:
        model = load_model(Path(cfg.init_from))
        tokenizer = load_tokenizer(Path(cfg.init_from))
    docs = load_corpus(cfg.data, max_bytes_per_domain=cfg.max_bytes_per_domain)
    data_fp = corpus_fingerprint(docs)
    if resume and not allow_data_change:
        _check_same_data(run_dir, run_info, data_fp)
    tokenizer, train_stream, val_streams = prepare_data(cfg, tokenizer, docs)
    del docs
    if model is None:
        if resume:  # run.json exists but no checkpoint yet: start over from the saved config
            model_cfg = ModelConfig.from_dict(run_info["model"])
        model_cfg.vocab_size = tokenizer.vocab_size
        torch.manual_seed(cfg.seed)
        model = MoETransformer(model_cfg)
    if cfg.lora_rank:
        if model.cfg.moe is None or not model.cfg.moe.experts.lora_rank:
            model = add_expert_lora(model, cfg.lora_rank, cfg.lora_alpha)
        freeze_all_but_lora(model)
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
    if cfg.expand_at is not None and (ckpt is None or ckpt.step <= cfg.expand_at):
        check_expansion(model.cfg, ExpandSpec.from_train_config(cfg), model)
    if parallel is not None and (cfg.expand_at is not None or cfg.optimizer != "adamw"):
        raise ConfigError(
            "--expert-parallel/--fsdp: train with AdamW and without --expand-at (width "
            "expansion and Muon are single-process or DDP features)"
        )
    model = model.to(device)
    if parallel is not None:  # validate the layout on every rank before anything is written
        if resume:
            parallel.check_resume(run_dir)
        model = parallel.prepare(model, dist_info.timeout)
    if dist_info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            tokenizer.save(run_dir)
            info = {
                "model": model.cfg.to_dict(),
                "train": cfg.to_dict(),
                "data_fingerprint": data_fp,
                "tokenizer_sha256": tokenizer_fingerprint(run_dir),
            }
            atomic_write_json(run_dir / RUN_FILE, info)
        elif allow_data_change:
            info = {**run_info, "data_fingerprint": data_fp}
            info["tokenizer_sha256"] = tokenizer_fingerprint(run_dir)
            atomic_write_json(run_dir / RUN_FILE, info)
    barrier(dist_info)
    on_main = MainRankWork(dist_info).run

    layers = moe_layers(model)
    module = _LossModule(model)
    step_fn = DDP(module) if dist_info.enabled and parallel is None else module
    if parallel is None:
        optimizer = build_optimizer(
            model, cfg, ckpt.state["optimizer"] if ckpt is not None else None
        )
    else:
        optimizer = PlainAdamW(model, cfg)
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + dist_info.rank)
    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    if ckpt is not None:
        torch.set_rng_state(ckpt.state["torch_rng"])
        set_device_rng_state(device, ckpt.state.get("device_rng"))
        generator.set_state(ckpt.state["generator"][dist_info.rank])
        start_step = ckpt.step
        tokens_seen = int(ckpt.state["tokens_seen"])
        elapsed_before = float(ckpt.state["elapsed_s"])
        if dist_info.is_main:
            # a resume from step 0 validates step 0 again: keep nothing then
            metrics.truncate_after(start_step if start_step > 0 else -1)
    elif (
        parallel is not None
        and resume
        and (state := parallel.load_checkpoint(run_dir, model, optimizer))
    ):
        torch.set_rng_state(state["torch_rng"])
        generator.set_state(state["generator"][dist_info.rank])
        start_step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        elapsed_before = float(state["elapsed_s"])
        if dist_info.is_main:
            metrics.truncate_after(start_step if start_step > 0 else -1)
    elif resume and dist_info.is_main:
        metrics.truncate_after(-1)

    saved_step = {"step": ckpt.step if ckpt is not None else None}
    # A resume replays the recorded fits and refits only after the last of them.
    fits = recorded_fits(run_info, cfg.warmup_steps) if resume else []
    fit_at = None
    if cfg.fit_to_budget:
        fit_at = fit_step(cfg.warmup_steps)
        if fits:
            fit_at = _validation_from(fits[-1].at_step + SKIP_STEPS + MIN_TIMED_STEPS, cfg)
    if fits:
        taken = [f for f in fits if f.at_step <= start_step]
        cfg = dataclasses.replace(cfg, steps=taken[-1].steps if taken else fits[0].requested_steps)
    step_times: list[float] = []
    last_s = {"eval": 0.0, "checkpoint": 0.0}  # the fit's cost of one of each

    def stop_requested() -> bool:
        """The stop flag, agreed by all ranks (so that no rank leaves a collective alone)."""
        if not dist_info.enabled:
            return stop.stop
        flag = torch.tensor([int(stop.stop)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        stop.stop = bool(flag.item())
        return stop.stop

    def checkpoint(step: int) -> None:
        t = time.perf_counter()
        saved_step["step"] = step
        gens = [generator.get_state()]
        if dist_info.enabled:  # on the device: NCCL gathers only GPU tensors
            mine = generator.get_state().to(device)
            gens = [torch.empty_like(mine) for _ in range(dist_info.world_size)]
            torch.distributed.all_gather(gens, mine)
            gens = [g.cpu() for g in gens]
        state = {
            "step": step,
            "torch_rng": torch.get_rng_state(),
            **({"device_rng": r} if (r := device_rng_state(device)) is not None else {}),
            "generator": gens,
            "tokens_seen": tokens_seen,
            "elapsed_s": elapsed_before + time.perf_counter() - t0,
        }
        if parallel is not None:  # collective: every rank writes its shard
            parallel.save_checkpoint(run_dir, model, optimizer, state, step)
        else:
            on_main(
                lambda: save_checkpoint(
                    run_dir, model, {**state, "optimizer": optimizer.state_dict()}, step
                ),
                "writing the checkpoint",
            )
        last_s["checkpoint"] = time.perf_counter() - t

    def validate(step: int) -> EvalResult | None:
        """Score the validation streams on rank 0 (on every rank when the model is sharded:
        its forward is collective) and log them; the result on rank 0, else None."""
        t = time.perf_counter()

        def score() -> EvalResult:
            return evaluate(
                model,
                val_streams,
                seq_len=cfg.seq_len,
                batch_size=cfg.batch_size,
                max_tokens=cfg.eval_tokens,
                doc_masks=cfg.doc_masks,
                nats_fn=batch_elbo_nats if model.cfg.objective == "block_diffusion" else None,
            )

        def log(result: EvalResult) -> EvalResult:
            metrics.write(_eval_record(step, result))
            bar.set_val(result.overall.bits_per_byte)
            return result

        if parallel is not None:
            scored = score()
            result = on_main(lambda: log(scored), "logging the validation")
        else:
            result = on_main(lambda: log(score()), "validating")
        last_s["eval"] = time.perf_counter() - t
        return result

    def run_probe(step: int) -> None:
        probe = on_step(step, model)
        if probe:
            metrics.write({"step": step, "split": "probe", **probe})

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * dist_info.world_size
    bar = TrainProgress(cfg.steps, enabled=progress and dist_info.is_main, start=start_step)
    model.train()
    if device.type == "cpu":
        # A first build of the fused kernel (30-40 s) is setup, not training: kept off
        # the time budget and out of the step-0 validation that --fit-to-budget costs.
        cpu_kernel.kernel()
    t0 = time.perf_counter()
    step = start_step
    last_loss = math.nan
    interrupted = False
    final_eval: EvalResult | None = None
    grace = stop_grace_s if dist_info.enabled else None
    with StopFlag(grace, dist_info.rank) as stop, bar:
        if start_step == 0:  # the starting point of the validation curve
            validate(0)
        while step < cfg.steps:
            if fit_at is not None and step >= fit_at and len(step_times) >= MIN_TIMED_STEPS:
                elapsed = elapsed_before + time.perf_counter() - t0
                cfg = _fit_to_budget(
                    cfg, run_dir, dist_info, device, step, elapsed, step_times, last_s, fits
                )
                bar.set_total(cfg.steps)
                step_times.clear()  # the next refit times the steps from here on
                fit_at = _validation_from(step + SKIP_STEPS + MIN_TIMED_STEPS, cfg)
            elif fits and fit_at is not None and step >= fit_at:  # too few timed since a resume
                fit_at = _validation_from(step + 1, cfg)
            elif due := [f for f in fits if f.at_step == step and f.steps != cfg.steps]:
                cfg = dataclasses.replace(cfg, steps=due[-1].steps)  # replayed on a resume
                bar.set_total(cfg.steps)
            if cfg.expand_at is not None and step == cfg.expand_at:
                grown = expand_in_training(
                    model, optimizer, ExpandSpec.from_train_config(cfg), cfg, train_stream, step
                )
                model, optimizer = grown.model, grown.optimizer
                layers = moe_layers(model)
                module = _LossModule(model)
                step_fn = DDP(module) if dist_info.enabled else module
                if dist_info.is_main:
                    metrics.write(expansion_record(step, model.cfg, grown.spec))
            progress = None
            if fits and step >= cfg.warmup_steps:
                progress = progress_at(
                    step,
                    warmup_steps=cfg.warmup_steps,
                    requested_steps=fits[0].requested_steps,
                    fits=fits,
                )
            lr = scheduled_lr(cfg, step, progress)
            optimizer.set_lr(step, lr)
            t_step = time.perf_counter()
            counts = [
                torch.zeros(layer.config.router.num_experts, dtype=torch.int64, device=device)
                for layer in layers
            ]
            ce_sum = aux_sum = 0.0
            n_bytes = 0
            gen_at_start, rng_at_start = generator.get_state(), torch.get_rng_state()
            device_rng_at_start = device_rng_state(device)
            for micro in range(cfg.grad_accum):
                if stop_requested():  # react within one micro-batch: abandon this step
                    break
                batch = sample_batch(train_stream, cfg.batch_size, cfg.seq_len, generator)
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
            if stop_requested():  # roll the abandoned step back; checkpoint the last finished one
                generator.set_state(gen_at_start)
                torch.set_rng_state(rng_at_start)
                set_device_rng_state(device, device_rng_at_start)
                optimizer.zero_grad(set_to_none=True)
                for layer in layers:
                    layer.reset_loss_state()
                if saved_step["step"] != step:
                    checkpoint(step)
                interrupted = True
                break
            if not math.isfinite(ce_sum):
                raise TrainingDivergedError(
                    f"step {step}: training loss is not finite; lower --lr or raise --warmup-steps"
                )
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
                    m.update_bias()
            step += 1
            tokens_seen += tokens_per_step
            dt = time.perf_counter() - t_step
            if fit_at is not None and step - start_step > SKIP_STEPS:
                step_times.append(dt)
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
            if on_step is not None:
                on_main(functools.partial(run_probe, step), "running on_step")
            over_budget = cfg.time_budget_s is not None and (
                elapsed_before + time.perf_counter() - t0 >= cfg.time_budget_s
            )
            if step % cfg.eval_every == 0 or step == cfg.steps or over_budget:
                final_eval = validate(step) or final_eval
            stopping = (
                stop_requested() or (stop_after is not None and step >= stop_after) or over_budget
            )
            if step >= cfg.steps:
                break  # the final checkpoint and model are written below
            if stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                checkpoint(step)
            if stopping:
                interrupted = stop.stop or (stop_after is not None and step >= stop_after)
                break
        if not interrupted and parallel is not None:
            parallel.save_model(model, run_dir)
        elif not interrupted:
            if saved_step["step"] != step:
                checkpoint(step)  # lets --resume complete a finish that is interrupted below
            on_main(  # the manifest, written last, marks the run finished
                lambda: save_model(model, run_dir, extra_files=tokenizer_files(run_dir)),
                "writing the final model",
            )
    barrier(dist_info)
    return TrainResult(
        run_dir=run_dir,
        step=step,
        interrupted=interrupted,
        final_eval=final_eval,
        train_loss=last_loss,
        elapsed_s=elapsed_before + time.perf_counter() - t0,
    )
