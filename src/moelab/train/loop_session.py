"""The training loop's running state (:mod:`moelab.train.loop`): the model and optimizer in
training, the batch generator, the metrics log and progress bar, and what the loop does
besides stepping: restoring a checkpoint, the agreed stop flag, checkpoints, validation,
``on_step`` probes, a width expansion and the finish."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from moelab.data import TokenStream
from moelab.data.fingerprint import tokenizer_files
from moelab.models import MoETransformer, save_model
from moelab.models.hooks import moe_layers
from moelab.train.checkpoint import Checkpoint, save_checkpoint
from moelab.train.config import TrainConfig
from moelab.train.device import device_rng_state, set_device_rng_state
from moelab.train.diffusion import batch_elbo_nats
from moelab.train.distributed import DistInfo
from moelab.train.evaluate import EvalResult, evaluate
from moelab.train.expand import ExpandSpec, expand_in_training, expansion_record
from moelab.train.loop_step import LossModule
from moelab.train.main_rank import MainRankWork
from moelab.train.metrics import MetricsLog
from moelab.train.optim import PlainAdamW, build_optimizer
from moelab.train.progress import TrainProgress


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


class TrainSession:
    """One run's state between setup and finish. Attributes the loop reads and updates:
    ``cfg`` (its ``steps`` refitted by the time budget), ``model``, ``optimizer``,
    ``layers`` (the MoE layers), ``module``/``step_fn`` (the loss module, DDP-wrapped for
    DDP runs), ``generator`` (this rank's batch sampler), ``tokens_seen``,
    ``elapsed_before`` (seconds trained before this process), ``start_step``, ``t0``
    (``perf_counter`` at the first step), ``saved_step`` (the last checkpointed step),
    ``last_s`` (the last validation's and checkpoint's seconds, for the budget fit) and
    ``stop`` (the :class:`~moelab.train.stopping.StopFlag`, set once the loop starts).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: MoETransformer,
        run_dir: Path,
        dist_info: DistInfo,
        device: torch.device,
        parallel: Any,
        ckpt: Checkpoint | None,
        val_streams: dict[str, TokenStream],
        on_step: Callable[[int, MoETransformer], dict[str, Any] | None] | None,
        progress: bool,
        evaluate_fn: Callable[..., EvalResult] = evaluate,
    ) -> None:
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        self.dist_info, self.device, self.parallel = dist_info, device, parallel
        self.val_streams, self.on_step = val_streams, on_step
        self.evaluate_fn = evaluate_fn  # the loop passes its module's name (fault injection)
        self.on_main = MainRankWork(dist_info).run
        self.set_model(model)
        if parallel is None:
            self.optimizer = build_optimizer(
                model, cfg, ckpt.state["optimizer"] if ckpt is not None else None
            )
        else:
            self.optimizer = PlainAdamW(model, cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + dist_info.rank)
        self.start_step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.saved_step = ckpt.step if ckpt is not None else None
        self.last_s = {"eval": 0.0, "checkpoint": 0.0}  # the budget fit's cost of one of each
        self.progress = progress
        self.bar: TrainProgress | None = None
        self.stop: Any = None
        self.t0 = time.perf_counter()

    def set_model(self, model: MoETransformer) -> None:
        """Train ``model`` from now on (its MoE layers, its loss module, DDP when a DDP run)."""
        self.model = model
        self.layers = moe_layers(model)
        self.module = LossModule(model)
        ddp = self.dist_info.enabled and self.parallel is None
        self.step_fn: nn.Module = DDP(self.module) if ddp else self.module

    def restore(self, ckpt: Checkpoint | None, resume: bool) -> None:
        """Continue from ``ckpt`` (or the parallel plan's sharded checkpoint on a resume): RNG
        states, this rank's batch generator, step, tokens and seconds so far, and the metrics
        log cut back to that step (a resume from step 0, or without a checkpoint, keeps
        none: step 0 is validated again)."""
        dist_info = self.dist_info
        state = None
        if ckpt is not None:
            state = ckpt.state
            set_device_rng_state(self.device, ckpt.state.get("device_rng"))
        elif self.parallel is not None and resume:
            state = self.parallel.load_checkpoint(self.run_dir, self.model, self.optimizer)
        if state:
            torch.set_rng_state(state["torch_rng"])
            self.generator.set_state(state["generator"][dist_info.rank])
            self.start_step = ckpt.step if ckpt is not None else int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
            self.elapsed_before = float(state["elapsed_s"])
            if dist_info.is_main:
                self.metrics.truncate_after(self.start_step if self.start_step > 0 else -1)
        elif resume and dist_info.is_main:
            self.metrics.truncate_after(-1)

    def elapsed_s(self) -> float:
        """Seconds trained in this run, earlier processes included."""
        return self.elapsed_before + time.perf_counter() - self.t0

    def any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over the ranks (one all-reduce; the local value without a process
        group): a decision that ends or changes the loop must be the same on every rank, or
        one rank leaves a collective alone."""
        if not self.dist_info.enabled:
            return flag
        agreed = torch.tensor([int(flag)], device=self.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        return bool(agreed.item())

    def stop_requested(self) -> bool:
        """The stop flag, agreed by all ranks (so that no rank leaves a collective alone).

        A signal whose handler runs after the flag was read for the all-reduce (the handler
        runs when the blocking call returns) stays set for the next check: the agreed value
        only ever sets the local flag, never clears it."""
        agreed = self.any_rank(self.stop.stop)
        if agreed:  # another rank's signal stops this one too
            self.stop.stop = True
        return agreed

    def checkpoint(self, step: int) -> None:
        """Write the checkpoint of optimizer step ``step`` (collective under a parallel plan:
        every rank writes its shard; else rank 0 writes it)."""
        t = time.perf_counter()
        self.saved_step = step
        dist_info, device = self.dist_info, self.device
        gens = [self.generator.get_state()]
        if dist_info.enabled:  # on the device: NCCL gathers only GPU tensors
            mine = self.generator.get_state().to(device)
            gens = [torch.empty_like(mine) for _ in range(dist_info.world_size)]
            torch.distributed.all_gather(gens, mine)
            gens = [g.cpu() for g in gens]
        state = {
            "step": step,
            "torch_rng": torch.get_rng_state(),
            **({"device_rng": r} if (r := device_rng_state(device)) is not None else {}),
            "generator": gens,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_s(),
        }
        model, optimizer = self.model, self.optimizer
        if self.parallel is not None:
            self.parallel.save_checkpoint(self.run_dir, model, optimizer, state, step)
        else:
            self.on_main(
                lambda: save_checkpoint(
                    self.run_dir, model, {**state, "optimizer": optimizer.state_dict()}, step
                ),
                "writing the checkpoint",
            )
        self.last_s["checkpoint"] = time.perf_counter() - t

    def validate(self, step: int) -> EvalResult | None:
        """Score the validation streams on rank 0 (on every rank when the model is sharded:
        its forward is collective) and log them; the result on rank 0, else None."""
        t = time.perf_counter()
        cfg, model = self.cfg, self.model

        def score() -> EvalResult:
            return self.evaluate_fn(
                model,
                self.val_streams,
                seq_len=cfg.seq_len,
                batch_size=cfg.batch_size,
                max_tokens=cfg.eval_tokens,
                doc_masks=cfg.doc_masks,
                nats_fn=batch_elbo_nats if model.cfg.objective == "block_diffusion" else None,
            )

        def log(result: EvalResult) -> EvalResult:
            self.metrics.write(_eval_record(step, result))
            self.bar.set_val(result.overall.bits_per_byte)
            return result

        if self.parallel is not None:
            scored = score()
            result = self.on_main(lambda: log(scored), "logging the validation")
        else:
            result = self.on_main(lambda: log(score()), "validating")
        self.last_s["eval"] = time.perf_counter() - t
        return result

    def probe(self, step: int) -> None:
        """Run ``on_step`` on rank 0 after optimizer step ``step`` and log what it returns."""

        def run_probe() -> None:
            probe = self.on_step(step, self.model)
            if probe:
                self.metrics.write({"step": step, "split": "probe", **probe})

        self.on_main(run_probe, "running on_step")

    def expand(self, stream: TokenStream, step: int) -> None:
        """Grow the model and optimizer as ``cfg`` asks, before optimizer step ``step``
        (:func:`moelab.train.expand.expand_in_training`), and log the expansion."""
        spec = ExpandSpec.from_train_config(self.cfg)
        grown = expand_in_training(self.model, self.optimizer, spec, self.cfg, stream, step)
        self.optimizer = grown.optimizer
        self.set_model(grown.model)
        if self.dist_info.is_main:
            self.metrics.write(expansion_record(step, self.model.cfg, grown.spec))

    def finish(self, step: int) -> None:
        """Write the final model: collectively under a parallel plan; else a checkpoint of
        ``step`` first (so ``--resume`` completes an interrupted finish), then the model with
        the manifest last, which marks the run finished."""
        if self.parallel is not None:
            self.parallel.save_model(self.model, self.run_dir)
            return
        if self.saved_step != step:
            self.checkpoint(step)
        model, run_dir = self.model, self.run_dir
        self.on_main(
            lambda: save_model(model, run_dir, extra_files=tokenizer_files(run_dir)),
            "writing the final model",
        )
