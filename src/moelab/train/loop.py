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

The code is split by concern: :mod:`~moelab.train.loop_setup` (the model a run trains and
``run.json``), :mod:`~moelab.train.loop_step` (one optimizer step),
:mod:`~moelab.train.loop_session` (checkpoints, validation, probes, an expansion, the
finish); this module holds the run folder's helpers, the data split and the loop itself.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelab.core.experts import cpu_kernel
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
from moelab.models import ModelConfig, MoETransformer, load_model
from moelab.models.hooks import moe_layers
from moelab.models.io import MANIFEST_FILE
from moelab.train.budget import (
    MIN_TIMED_STEPS,
    SKIP_STEPS,
    fit_step,
    fit_steps,
    progress_at,
    recorded_fits,
)
from moelab.train.checkpoint import checkpoint_dirs, load_checkpoint
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.device import device_rng_state, resolve_device, set_device_rng_state
from moelab.train.distributed import (
    DEFAULT_DIST_TIMEOUT_S,
    DistInfo,
    barrier,
    init_distributed,
    shutdown,
    timeout_error,
)
from moelab.train.evaluate import EvalResult, evaluate
from moelab.train.loop_session import TrainSession
from moelab.train.loop_setup import RUN_FILE, prepare_model, write_run_info
from moelab.train.loop_step import (
    accumulate_gradients,
    apply_update,
    load_imbalance,
    mixed_precision,
    train_record,
)
from moelab.train.progress import TrainProgress
from moelab.train.schedule import scheduled_lr
from moelab.train.stopping import DEFAULT_STOP_GRACE_S, StopFlag, check_stop_grace
from moelab.utils.atomic import atomic_write_json
from moelab.utils.jsonfile import read_json
from moelab.utils.locking import folder_lock


@dataclass
class TrainResult:
    """What a finished (or interrupted) run reports."""

    run_dir: Path
    step: int
    interrupted: bool
    final_eval: EvalResult | None
    train_loss: float
    elapsed_s: float


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
    seed = cfg.seed if cfg.split_seed is None else cfg.split_seed
    train_docs, val_docs = split_documents(docs, val_fraction=cfg.val_fraction, seed=seed)
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
    model = prepare_model(model, cfg, tokenizer, ckpt, parallel).to(device)
    if parallel is not None:  # validate the layout on every rank before anything is written
        if resume:
            parallel.check_resume(run_dir)
        model = parallel.prepare(model, dist_info.timeout)
    if dist_info.is_main:
        write_run_info(
            run_dir,
            model,
            cfg,
            tokenizer,
            data_fp,
            resume=resume,
            allow_data_change=allow_data_change,
            run_info=run_info if resume else {},
        )
    barrier(dist_info)

    run = TrainSession(
        cfg, model, run_dir, dist_info, device, parallel, ckpt, val_streams, on_step, progress,
        evaluate_fn=evaluate,
    )  # fmt: skip
    run.restore(ckpt, resume)
    start_step = run.start_step
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
    run.cfg = cfg
    step_times: list[float] = []

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * dist_info.world_size
    bar = TrainProgress(cfg.steps, enabled=progress and dist_info.is_main, start=start_step)
    run.bar = bar
    run.model.train()
    if device.type == "cpu":
        # A first build of the fused kernel (30-40 s) is setup, not training: kept off
        # the time budget and out of the step-0 validation that --fit-to-budget costs.
        cpu_kernel.kernel()
    run.t0 = time.perf_counter()
    step = start_step
    last_loss = math.nan
    interrupted = False
    final_eval: EvalResult | None = None
    grace = stop_grace_s if dist_info.enabled else None
    with StopFlag(grace, dist_info.rank) as stop, bar:
        run.stop = stop
        if start_step == 0:  # the starting point of the validation curve
            run.validate(0)
        while step < cfg.steps:
            if fit_at is not None and step >= fit_at and len(step_times) >= MIN_TIMED_STEPS:
                cfg = _fit_to_budget(
                    cfg, run_dir, dist_info, device, step, run.elapsed_s(), step_times,
                    run.last_s, fits,
                )  # fmt: skip
                run.cfg = cfg
                bar.set_total(cfg.steps)
                step_times.clear()  # the next refit times the steps from here on
                fit_at = _validation_from(step + SKIP_STEPS + MIN_TIMED_STEPS, cfg)
            elif fits and fit_at is not None and step >= fit_at:  # too few timed since a resume
                fit_at = _validation_from(step + 1, cfg)
            elif due := [f for f in fits if f.at_step == step and f.steps != cfg.steps]:
                cfg = dataclasses.replace(cfg, steps=due[-1].steps)  # replayed on a resume
                run.cfg = cfg
                bar.set_total(cfg.steps)
            if cfg.expand_at is not None and step == cfg.expand_at:
                run.expand(train_stream, step)
            schedule_progress = None
            if fits and step >= cfg.warmup_steps:
                schedule_progress = progress_at(
                    step,
                    warmup_steps=cfg.warmup_steps,
                    requested_steps=fits[0].requested_steps,
                    fits=fits,
                )
            lr = scheduled_lr(cfg, step, schedule_progress)
            run.optimizer.set_lr(step, lr)
            t_step = time.perf_counter()
            gen_at_start, rng_at_start = run.generator.get_state(), torch.get_rng_state()
            device_rng_at_start = device_rng_state(device)
            stats = accumulate_gradients(
                run.step_fn, run.module, run.layers, train_stream, cfg, run.generator, device,
                run.stop_requested, sample_batch,  # looked up here: fault tests patch it
            )  # fmt: skip
            if run.stop_requested():  # roll the abandoned step back; checkpoint the last one
                run.generator.set_state(gen_at_start)
                torch.set_rng_state(rng_at_start)
                set_device_rng_state(device, device_rng_at_start)
                run.optimizer.zero_grad(set_to_none=True)
                for layer in run.layers:
                    layer.reset_loss_state()
                if run.saved_step != step:
                    run.checkpoint(step)
                interrupted = True
                break
            if not math.isfinite(stats.ce_sum):
                raise TrainingDivergedError(
                    f"step {step}: training loss is not finite; lower --lr or raise --warmup-steps"
                )
            grad_norm = apply_update(
                run.model, run.optimizer, run.layers, stats.counts, cfg, parallel
            )
            step += 1
            run.tokens_seen += tokens_per_step
            dt = time.perf_counter() - t_step
            if fit_at is not None and step - start_step > SKIP_STEPS:
                step_times.append(dt)
            last_loss = stats.ce_sum / cfg.grad_accum
            bar.update(
                step,
                loss=last_loss,
                aux=stats.aux_sum / cfg.grad_accum,
                tok_s=tokens_per_step / dt,
                imbalance=max(load_imbalance(stats.counts), default=0.0),
            )
            if dist_info.is_main and (step % cfg.log_every == 0 or step == cfg.steps):
                rec = train_record(
                    step, stats, cfg, lr=lr, grad_norm=grad_norm, tokens=run.tokens_seen,
                    tokens_per_s=tokens_per_step / dt,
                )  # fmt: skip
                run.metrics.write(rec)
            if on_step is not None:
                run.probe(step)
            # each rank's clock is its own: every rank stops when the first is over budget
            over_budget = cfg.time_budget_s is not None and run.any_rank(
                run.elapsed_s() >= cfg.time_budget_s
            )
            if step % cfg.eval_every == 0 or step == cfg.steps or over_budget:
                final_eval = run.validate(step) or final_eval
            halted = run.stop_requested() or (stop_after is not None and step >= stop_after)
            if step >= cfg.steps:
                break  # the final checkpoint and model are written below
            if halted or over_budget or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                run.checkpoint(step)
            if halted or over_budget:
                interrupted = halted  # a run over its budget finishes
                break
        if not interrupted:
            run.finish(step)
    barrier(dist_info)
    return TrainResult(
        run_dir=run_dir,
        step=step,
        interrupted=interrupted,
        final_eval=final_eval,
        train_loss=last_loss,
        elapsed_s=run.elapsed_s(),
    )


__all__ = [
    "RUN_FILE",
    "TrainResult",
    "domain_streams",
    "mixed_precision",
    "moe_layers",
    "prepare_data",
    "read_run_info",
    "run_finished",
    "run_train_config",
    "split_run_documents",
    "train",
    "validation_streams",
]
