"""TrainConfig and the run-config file format (``--config FILE``: YAML, JSON or TOML)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from moelab.errors import UserError
from moelab.utils.fields import check_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(UserError, ValueError):
    """A config file or value is invalid; the message names the file or field."""


@dataclass
class TrainConfig:
    """Hyperparameters of ``moelab train`` (every field has a CLI flag).

    Attributes:
        data: corpus spec (``mix``, ``stdlib``, ``shakespeare``, ``kjv``, or a path/glob).
        max_bytes_per_domain: cap per domain of the corpus (whole documents), None = all.
        val_fraction: fraction of documents held out for validation (per domain).
        tokenizer: ``byte`` (256 symbols) or ``bpe`` (trained on the training split).
        bpe_vocab_size: vocabulary of the BPE tokenizer.
        seq_len: context length in tokens.
        batch_size: sequences per micro-batch (per process).
        grad_accum: micro-batches per optimizer step.
        steps: optimizer steps.
        lr: peak learning rate of AdamW; min_lr_ratio: final lr / peak lr of the cosine decay.
        warmup_steps: linear warmup steps.
        weight_decay, beta1, beta2, eps: AdamW (decay on matrices only, not norms/biases).
        grad_clip: max global gradient norm (0 = off).
        eval_every: steps between validations; eval_tokens: validation tokens per domain
            per evaluation.
        checkpoint_every: steps between checkpoints (0 = only at the end and on Ctrl-C).
        log_every: steps between metric lines in ``metrics.jsonl``.
        time_budget_s: stop after this many seconds of training (None = run all steps).
        fit_to_budget: fit the total steps (at most ``steps``) to ``time_budget_s`` after
            timing the first steps, and again after every validation, so that the cosine
            ends with the budget (:mod:`moelab.train.budget`); needs ``time_budget_s``.
        seed: seeds the model init, the batch order and (unless ``split_seed`` is given)
            the data split.
        split_seed: seeds the train/validation document split alone; None = ``seed``. A
            comparison over several seeds sets it to one value so that every seed is scored
            on the same held-out documents and per-seed differences are paired.
        init_from: a model folder (e.g. from ``moelab upcycle``) whose weights and tokenizer
            start the run instead of a random init.
        optimizer: ``adamw``, or ``muon`` (``torch.optim.Muon`` on the 2-D hidden matrices,
            AdamW on the rest; :mod:`moelab.train.optim`).
        expand_at: grow the model's width before this optimizer step (0-based; SPARKLING,
            :mod:`moelab.train.expand`); in ``[1, steps-1]``; None = never.
        expand_hidden, expand_expert: width factors (> 1) of the hidden size D (attention
            heads and head_dim kept) and of the expert / dense-FFN inner size F; None =
            unchanged.
        expand_init: ``sparkling`` (the paper's copy-copy init with its analytic fan-in
            scale, ½ at 2×), ``random`` (random new entries at the old RMS, fitted scale; the
            paper's random-random ablation), ``naive`` (default init) or ``copy`` (function
            preserving, Net2Net / HyperCloning).
        expand_state: ``asymmetric`` (the paper's: old entries keep their optimizer state
            unscaled, new ones start at zero with their own step counter and re-warm),
            ``scaled`` (the same with the old state scaled like the weights) or
            ``symmetric`` (new entries join the old schedule: copied state for the copy
            inits, zeros otherwise, no re-warmup).
        rewarm_steps: τ_w, steps over which the new entries' learning rate rises from the
            current rate to ``rewarm_ratio`` times it (None = 0.8 % of the steps left after
            the expansion, at most the paper's 250, at least 1; 0 = no re-warmup with
            ``rewarm_tail="base"``, a jump to the peak with ``"own"``).
        rewarm_ratio: ρ, the new entries' re-warmup peak over the rate at the expansion
            (SPARKLING Eq. 27; paper 1.3).
        rewarm_tail: ``base`` (default [I]): after the rise the new entries' rate falls back
            onto the base schedule over another ``rewarm_steps`` and follows it (a short
            re-warmup); ``own``: their own cosine from the peak to the base minimum
            (moelab's earlier reading of SPARKLING Eq. 28: they stay above the old entries'
            rate for the rest of the run). See :func:`moelab.train.schedule.rewarm_boost`.
        lora_rank: > 0 adds LoRA adapters of this rank to every expert bank (unless the
            model has them) and trains only the adapters (:mod:`moelab.models.lora`).
        lora_alpha: α of the adapters' scale α/r.
        doc_masks: training windows cut across documents; with this each document attends
            only to itself and the sequence-level balance loss is per document (packed
            sequences, :mod:`moelab.models.packing`); validation does the same.
        allow_noncausal_routing: train a model whose routing looks at future tokens (USMoE
            ``sequence``/``batch`` selection scopes); refused otherwise, since such a model is
            not a causal LM and its losses are not causal LM losses.
        objective: ``causal`` (next-token CE) or ``block-diffusion`` (the masked
            block-diffusion ELBO of :mod:`moelab.train.diffusion`; a causal model, e.g. from
            ``init_from``, is first turned into a block-diffusion one with a new mask token).
        block_size: tokens per diffusion block (``seq_len`` must be a multiple of it).
        precision: ``fp32``, or ``bf16``: the training forward runs under
            ``torch.autocast(dtype=torch.bfloat16)`` (mixed precision: float32 weights,
            gradients and AdamW state; bf16 GEMMs and attention; the router, the combine and
            the loss stay float32). Validation always runs in float32.
    """

    data: str = "mix"
    max_bytes_per_domain: int | None = 1_500_000
    val_fraction: float = 0.05
    tokenizer: str = "byte"
    bpe_vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 49_152
    checkpoint_every: int = 100
    log_every: int = 10
    time_budget_s: float | None = None
    fit_to_budget: bool = False
    seed: int = 0
    split_seed: int | None = None
    init_from: str | None = None
    optimizer: str = "adamw"
    expand_at: int | None = None
    expand_hidden: float | None = None
    expand_expert: float | None = None
    expand_init: str = "sparkling"
    expand_state: str = "asymmetric"
    rewarm_steps: int | None = None
    rewarm_ratio: float = 1.3
    rewarm_tail: str = "base"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    doc_masks: bool = False
    allow_noncausal_routing: bool = False
    objective: str = "causal"
    block_size: int = 8
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_fields(self, ConfigError)
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        positive = (
            "seq_len",
            "batch_size",
            "grad_accum",
            "steps",
            "eval_every",
            "eval_tokens",
            "log_every",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.tokenizer not in ("byte", "bpe"):
            raise ConfigError(f"tokenizer: must be byte or bpe, got {self.tokenizer!r}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"val_fraction: must be in (0, 1), got {self.val_fraction}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr: must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ConfigError(f"eps: must be a finite number > 0, got {self.eps}")
        for name in ("warmup_steps", "checkpoint_every", "grad_clip", "weight_decay"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{name}: must be a finite number >= 0, got {v}")
        if self.time_budget_s is not None and not (
            math.isfinite(self.time_budget_s) and self.time_budget_s > 0
        ):
            raise ConfigError(f"time_budget_s: must be > 0 seconds, got {self.time_budget_s}")
        if self.fit_to_budget and self.time_budget_s is None:
            raise ConfigError("fit_to_budget: needs a time budget (--time-budget SECONDS)")
        if self.fit_to_budget and self.expand_at is not None:
            raise ConfigError(
                "fit_to_budget: not with expand_at (the expansion step is fixed before the "
                "total steps are known)"
            )
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank: must be >= 0, got {self.lora_rank}")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"lora_alpha: must be a finite number > 0, got {self.lora_alpha}")
        if self.objective not in ("causal", "block-diffusion"):
            raise ConfigError(
                f"objective: must be causal or block-diffusion, got {self.objective!r}"
            )
        if self.block_size < 1 or (
            self.objective == "block-diffusion" and self.seq_len % self.block_size
        ):
            raise ConfigError(
                f"block_size: must be >= 1 and divide seq_len={self.seq_len}, got {self.block_size}"
            )
        if not self.data.strip():
            raise ConfigError("data: empty corpus name or path")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision: must be fp32 or bf16, got {self.precision!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"optimizer: must be adamw or muon, got {self.optimizer!r}")
        self._check_expansion()

    def _check_expansion(self) -> None:
        factors = {"expand_hidden": self.expand_hidden, "expand_expert": self.expand_expert}
        for name, f in factors.items():
            if f is not None and not (math.isfinite(f) and f > 1):
                raise ConfigError(
                    f"{name}: a width factor must be a finite number > 1 (expansion cannot shrink), got {f:g}"
                )
        if self.expand_init not in ("sparkling", "random", "naive", "copy"):
            raise ConfigError(
                f"expand_init: must be sparkling, random, naive or copy, got {self.expand_init!r}"
            )
        if self.expand_state not in ("asymmetric", "scaled", "symmetric"):
            raise ConfigError(
                f"expand_state: must be asymmetric, scaled or symmetric, got {self.expand_state!r}"
            )
        if self.rewarm_steps is not None and self.rewarm_steps < 0:
            raise ConfigError(f"rewarm_steps: must be >= 0, got {self.rewarm_steps}")
        if not self.rewarm_ratio > 0:
            raise ConfigError(f"rewarm_ratio: must be > 0, got {self.rewarm_ratio}")
        if self.rewarm_tail not in ("base", "own"):
            raise ConfigError(f"rewarm_tail: must be base or own, got {self.rewarm_tail!r}")
        if self.expand_at is None:
            if any(f is not None for f in factors.values()):
                raise ConfigError("expand_at: a width factor is set but no expansion step")
            return
        if not 1 <= self.expand_at < self.steps:
            raise ConfigError(
                f"expand_at: must be in [1, steps-1={self.steps - 1}] (before the last step), "
                f"got {self.expand_at}"
            )
        if all(f is None for f in factors.values()):
            raise ConfigError("expand_at: needs expand_hidden and/or expand_expert")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"train: unknown field(s) {', '.join(unknown)}")
        return cls(**d)


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_type(name: str, value: Any, annotation: str) -> None:
    """Check ``value`` against a field annotation such as ``"int"`` or ``"float | None"``."""
    kinds = [k.strip() for k in str(annotation).split("|")]
    if value is None and "None" in kinds:
        return
    allowed = tuple(t for k in kinds for t in _TYPES.get(k, ()))
    if (isinstance(value, bool) and "bool" not in kinds) or not isinstance(value, allowed):
        want = " or ".join(k for k in kinds if k != "None")
        raise ConfigError(f"{name}: expected {want}, got {value!r} ({type(value).__name__})")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml), JSON (.json) or TOML (.toml) file into a dict.

    The file holds up to two sections, ``model`` (ModelConfig fields, with a nested ``moe``)
    and ``train`` (TrainConfig fields).

    Raises:
        ConfigError: missing file, unknown extension, parse error, or other top-level keys.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason})") from e
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(
                f"{path}: unknown config format {path.suffix!r} (use .yaml, .json or .toml)"
            )
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}".splitlines()[0]) from e
    if not isinstance(data, dict) or set(data) - {"model", "train"}:
        raise ConfigError(f"{path}: expected top-level sections 'model' and/or 'train'")
    for section, body in list(data.items()):
        if body is None:
            data[section] = {}
        elif not isinstance(body, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping of fields")
    return data
