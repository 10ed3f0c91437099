"""The training loop's setup (:mod:`moelab.train.loop`): the model a run trains (adapters, the
block-diffusion conversion and every check against the run's settings) and the ``run.json``
written before the first step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moelab.data import Tokenizer
from moelab.data.fingerprint import tokenizer_fingerprint
from moelab.models import MoETransformer
from moelab.models.block_diffusion import to_block_diffusion
from moelab.models.lora import add_expert_lora, freeze_all_but_lora
from moelab.train.checkpoint import Checkpoint
from moelab.train.config import ConfigError, TrainConfig
from moelab.train.expand import ExpandSpec, check_expansion
from moelab.utils.atomic import atomic_write_json

RUN_FILE = "run.json"


def prepare_model(
    model: MoETransformer,
    cfg: TrainConfig,
    tokenizer: Tokenizer,
    ckpt: Checkpoint | None,
    parallel: Any,
) -> MoETransformer:
    """``model`` as the run trains it: expert LoRA added and everything else frozen
    (``cfg.lora_rank``), converted to block diffusion (``cfg.objective``), after checking
    it against the run (vocabulary, block size, causal routing, sequence length, a pending
    expansion, the parallel plan's limits). Not yet on the device.

    Raises:
        ConfigError: the model does not fit the run's settings (one line naming the value).
        InvalidValueError, ModelTooLargeError: a pending expansion cannot grow this model.
    """
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
    return model


def write_run_info(
    run_dir: Path,
    model: MoETransformer,
    cfg: TrainConfig,
    tokenizer: Tokenizer,
    data_fp: dict[str, Any],
    *,
    resume: bool,
    allow_data_change: bool,
    run_info: dict[str, Any],
) -> None:
    """Rank 0, before the first step: a new run saves its tokenizer and ``run.json`` (model and
    training settings, corpus and tokenizer fingerprints); a resume that allows a data change
    records the new fingerprints in ``run_info``'s place."""
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
