"""``moelab train``: train an MoE (or dense twin) language model on real text."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from moelab.cli._app import Opt, app, console, fail, guarded
from moelab.cli._common import check_not_store, summary_table
from moelab.cli._options import ConfigOption, nested, option_parameters, with_options
from moelab.cli._ranges import Range
from moelab.errors import InvalidValueError
from moelab.models import ModelConfig
from moelab.train.config import TrainConfig
from moelab.train.distributed import DEFAULT_DIST_TIMEOUT_S, MAX_DIST_TIMEOUT_S
from moelab.train.stopping import DEFAULT_STOP_GRACE_S

# One line per option: flag name, the config field it sets, help. Types come from the field.
MODEL_OPTIONS = [
    ConfigOption("d_model", "d_model", "Model width D."),
    ConfigOption("layers", "n_layers", "Decoder layers."),
    ConfigOption("heads", "n_heads", "Attention heads."),
    ConfigOption("kv_heads", "n_kv_heads", "Key/value heads (GQA)."),
    ConfigOption("first_dense", "first_dense_layers", "First n layers dense (DeepSeek style)."),
    ConfigOption("moe_every", "moe_layer_step", "One MoE layer every N layers (HF decoder_sparse_step)."),
    ConfigOption("experts", "moe.router.num_experts", "Routed experts E."),
    ConfigOption("top_k", "moe.router.top_k", "Experts per token k."),
    ConfigOption("router", "moe.router.kind", "Routing rule."),
    ConfigOption("score_func", "moe.router.score_func", "Router scores."),
    ConfigOption("norm_topk_prob", "moe.router.norm_topk_prob",
                 "Renormalise the k combine weights to sum 1 (default: on for k > 1, off for k = 1)."),
    ConfigOption("softmax_before_topk", "moe.router.softmax_before_topk",
                 "Softmax over all experts before top-k (off: top-k on logits, then softmax)."),
    ConfigOption("routed_scale", "moe.router.routed_scaling_factor", "Scale of the combine weights."),
    ConfigOption("n_group", "moe.router.n_group", "Group-limited routing: expert groups."),
    ConfigOption("topk_group", "moe.router.topk_group", "Group-limited routing: groups kept per token."),
    ConfigOption("group_score", "moe.router.group_score",
                 "Group score: top2 (DeepSeek-V3) or topk_per_group (Megatron)."),
    ConfigOption("capacity_factor", "moe.router.capacity_factor", "Expert capacity factor (default dropless)."),
    ConfigOption("drop_policy", "moe.router.drop_policy", "Which pairs an over-full expert keeps."),
    ConfigOption("expert_bias", "moe.router.expert_bias", "Aux-loss-free bias balancing (DeepSeek-V3)."),
    ConfigOption("bias_rate", "moe.router.bias_update_rate", "Bias update rate γ."),
    ConfigOption("jitter", "moe.router.jitter_eps", "Router input jitter ε in training (0 = off)."),
    ConfigOption("logit_noise", "moe.router.logit_noise_std",
                 "Additive Gaussian router-logit noise σ in training (0 = off)."),
    ConfigOption("force_uniform", "moe.router.force_uniform",
                 "Benchmarking: round-robin expert assignment (exact balance)."),
    ConfigOption("usmoe_budget", "moe.router.budget_fraction",
                 "USMoE: routed pairs as a fraction of T·k (per sequence)."),
    ConfigOption("usmoe_rate", "moe.router.usmoe_rate", "USMoE: r of the unified score."),
    ConfigOption("usmoe_scope", "moe.router.selection_scope", "USMoE selection group (default position)."),
    ConfigOption("usmoe_weight_norm", "moe.router.usmoe_weight_norm", "USMoE combine weights."),
    ConfigOption("expert_ffn", "moe.experts.ffn_hidden_size", "Hidden width F of each expert."),
    ConfigOption("activation", "moe.experts.activation", "Expert activation."),
    ConfigOption("shared_expert", "moe.experts.shared_expert_size", "Hidden width of a shared expert (0 = none)."),
    ConfigOption("aux_loss", "moe.losses.load_balance", "Load-balancing loss."),
    ConfigOption("aux_coeff", "moe.losses.aux_loss_coeff", "Load-balancing loss coefficient."),
    ConfigOption("z_coeff", "moe.losses.z_loss_coeff", "Router z-loss coefficient."),
    ConfigOption("spec_loss", "moe.losses.specialization", "Specialization loss between co-activated experts."),
    ConfigOption("spec_coeff", "moe.losses.specialization_coeff", "Specialization loss coefficient."),
    ConfigOption("cross_loss", "moe.losses.cross_layer", "Cross-layer dependency loss between adjacent MoE layers."),
    ConfigOption("cross_coeff", "moe.losses.cross_layer_coeff", "Cross-layer loss coefficient."),
    ConfigOption("cross_variant", "moe.losses.cross_layer_variant", "Cross-layer loss variant."),
]  # fmt: skip
TRAIN_OPTIONS = [
    ConfigOption("data", "data", "Corpus: mix, stdlib, shakespeare, kjv, or a file/folder/glob."),
    ConfigOption("init_from", "init_from", "Start from a model folder (e.g. made by `moelab upcycle`)."),
    ConfigOption("steps", "steps", "Optimizer steps."),
    ConfigOption("batch_size", "batch_size", "Sequences per micro-batch."),
    ConfigOption("seq_len", "seq_len", "Context length."),
    ConfigOption("grad_accum", "grad_accum", "Micro-batches per step."),
    ConfigOption("lr", "lr", "Peak learning rate."),
    ConfigOption("warmup_steps", "warmup_steps", "Warmup steps."),
    ConfigOption("weight_decay", "weight_decay", "AdamW weight decay."),
    ConfigOption("grad_clip", "grad_clip", "Gradient clipping norm (0 = off)."),
    ConfigOption("eval_every", "eval_every", "Steps between validations."),
    ConfigOption("eval_tokens", "eval_tokens", "Validation tokens per evaluation."),
    ConfigOption("checkpoint_every", "checkpoint_every", "Steps between checkpoints."),
    ConfigOption("log_every", "log_every", "Steps between metrics.jsonl lines."),
    ConfigOption("val_fraction", "val_fraction", "Fraction of documents held out."),
    ConfigOption("min_lr_ratio", "min_lr_ratio", "Final lr / peak lr of the cosine."),
    ConfigOption("beta1", "beta1", "AdamW β1."),
    ConfigOption("beta2", "beta2", "AdamW β2."),
    ConfigOption("adam_eps", "eps", "AdamW ε."),
    ConfigOption("tokenizer", "tokenizer", "Tokenizer."),
    ConfigOption("bpe_vocab_size", "bpe_vocab_size", "BPE vocabulary size."),
    ConfigOption("max_bytes_per_domain", "max_bytes_per_domain", "Cap per corpus domain, bytes."),
    ConfigOption("time_budget", "time_budget_s", "Stop after this many seconds."),
    ConfigOption("fit_to_budget", "fit_to_budget",
                 "Fit the total steps (at most --steps) to --time-budget after the warmup, refitted after each validation."),
    ConfigOption("seed", "seed", "Random seed."),
    ConfigOption("split_seed", "split_seed", "Seed of the train/validation split alone (default: --seed); fix it to compare seeds on one held-out set."),
    ConfigOption("allow_noncausal_routing", "allow_noncausal_routing",
                 "Allow USMoE scopes that look at future tokens (not a causal LM)."),
    ConfigOption("lora_rank", "lora_rank", "Train only LoRA adapters of this rank on the experts."),
    ConfigOption("lora_alpha", "lora_alpha", "LoRA scale α (the adapters add α/r·A·B)."),
    ConfigOption("doc_masks", "doc_masks", "Attention and sequence losses per document in each window."),
    ConfigOption("optimizer", "optimizer", "adamw, or muon (Muon on 2-D matrices, AdamW on the rest)."),
    ConfigOption("expand_at", "expand_at", "Grow the width before this step (SPARKLING)."),
    ConfigOption("expand_hidden", "expand_hidden", "Hidden-size factor of the expansion (or --expand)."),
    ConfigOption("expand_expert", "expand_expert", "Expert/FFN inner-size factor (or --expand)."),
    ConfigOption("expand_init", "expand_init", "Expansion init: sparkling (paper: copy-copy, fan-in x1/2 at 2x), random, naive or copy."),
    ConfigOption("expand_state", "expand_state", "Expansion optimizer state: asymmetric (paper), scaled or symmetric."),
    ConfigOption("rewarm_steps", "rewarm_steps", "Steps the new entries' LR rises to --rewarm-ratio x (default 0.8 % of the rest, <= 250)."),
    ConfigOption("rewarm_ratio", "rewarm_ratio", "Re-warmup peak of the new entries over the LR at the expansion (paper 1.3)."),
    ConfigOption("rewarm_tail", "rewarm_tail", "After the re-warmup: base (fall back onto the old entries' schedule) or own (their own cosine to the end)."),
    ConfigOption("objective", "objective", "causal, or block-diffusion (masked block diffusion, +1 mask id)."),
    ConfigOption("block_size", "block_size", "Diffusion block size (divides --seq-len)."),
    ConfigOption("precision", "precision", "fp32, or bf16 (mixed precision: bf16 GEMMs, float32 weights and router)."),
]  # fmt: skip


def build_configs(
    config_file: Path | None, model_flags: dict[str, Any], train_flags: dict[str, Any], dense: bool
):
    """defaults < ``--config`` file < explicit flags. Returns (ModelConfig, TrainConfig).

    ``model_flags`` is keyed by flag name (:data:`MODEL_OPTIONS`), ``train_flags`` by flag
    name or TrainConfig field; None or a missing key means "not given".

    Raises:
        ConfigError / ValueError: a bad file or value, naming the field.
    """
    from moelab.models import dense_twin_config
    from moelab.train.config import ConfigError, read_config_file
    from moelab.train.presets import default_model_dict, default_train_dict, merge

    file_cfg = read_config_file(config_file) if config_file else {}
    train_dict = merge(default_train_dict(), file_cfg.get("train", {}))
    train_flags = nested(TRAIN_OPTIONS, train_flags) if _by_flag(train_flags) else train_flags
    train_cfg = TrainConfig.from_dict(merge(train_dict, train_flags, skip_none=True))
    model_dict = merge(default_model_dict(), file_cfg.get("model", {}))
    model_dict = merge(model_dict, nested(MODEL_OPTIONS, model_flags), skip_none=True)
    if isinstance(model_dict.get("moe"), dict):
        model_dict["moe"].setdefault("experts", {})["hidden_size"] = model_dict.get("d_model")
        _usmoe_without_balancing(model_dict["moe"], file_cfg, model_flags)
    if (
        isinstance(model_dict.get("max_seq_len"), int)
        and train_cfg.seq_len > model_dict["max_seq_len"]
    ):
        model_dict["max_seq_len"] = train_cfg.seq_len
    try:
        model_cfg = ModelConfig.from_dict(model_dict)
    except TypeError as e:
        raise ConfigError(f"model: {e}") from e
    if dense:
        model_cfg = dense_twin_config(model_cfg)
    return model_cfg, _absolute_paths(train_cfg)


def _usmoe_without_balancing(moe: dict, file_cfg: dict, model_flags: dict) -> None:
    """Training-based USMoE as released uses no load-balancing loss (its configured gate is
    never built; see :mod:`moelab.core.routers.usmoe`): the default unless one is given."""
    file_losses = ((file_cfg.get("model") or {}).get("moe") or {}).get("losses") or {}
    router = moe.get("router")
    if (
        isinstance(router, dict)
        and router.get("kind") == "usmoe"
        and model_flags.get("aux_loss") is None
        and "load_balance" not in file_losses
    ):
        moe.setdefault("losses", {})["load_balance"] = "none"


def _absolute_paths(cfg):
    """Store user paths absolute in run.json so eval/analyze/--resume work from anywhere."""
    from moelab.data import PACKAGED_CORPORA

    data = (
        cfg.data
        if cfg.data in PACKAGED_CORPORA or not Path(cfg.data).exists()
        else str(Path(cfg.data).resolve())
    )
    init_from = str(Path(cfg.init_from).resolve()) if cfg.init_from else None
    return dataclasses.replace(cfg, data=data, init_from=init_from)


def _by_flag(flags: dict[str, Any]) -> bool:
    """True when ``flags`` uses flag names (``time_budget``) rather than field names."""
    fields = {o.field for o in TRAIN_OPTIONS}
    return any(k not in fields for k in flags) or not flags


def train(
    out: Annotated[Path | None, Opt(help="Run folder (default runs/<name>).")] = None,
    name: Annotated[str, Opt(help="Run name under runs/.")] = "main",
    config: Annotated[
        Path | None, Opt("--config", help="YAML/JSON/TOML file with 'model' and 'train' sections.")
    ] = None,
    resume: Annotated[
        bool, Opt(help="Continue the run in --out from its latest checkpoint.")
    ] = False,
    dense: Annotated[
        bool, Opt(help="Train the dense twin (same active parameters per token).")
    ] = False,
    progress: Annotated[bool, Opt(help="Show the progress bar.")] = True,
    expand: Annotated[str | None, Opt(help="Width factors, e.g. hidden=2x,expert=2x.")] = None,
    allow_data_change: Annotated[
        bool, Opt(help="--resume even though the corpus changed since the run started.")
    ] = False,
    expert_parallel: Annotated[
        int | None,
        Opt(help="Ranks per expert-parallel group (torchrun; world = DP × EP)."),
        Range(min=1),
    ] = None,
    fsdp: Annotated[bool, Opt(help="FSDP2 for the non-expert parameters (torchrun).")] = False,
    device: Annotated[
        str,
        Opt(
            help="auto (CUDA when present), cpu, cuda or cuda:N; torchrun: cuda:$LOCAL_RANK. "
            "Not a run setting: --resume may change it."
        ),
    ] = "auto",
    dist_timeout: Annotated[
        float,
        Opt(
            help="torchrun: seconds a rank waits for another before it stops with an error "
            "(a stopped or hung rank). Not a run setting."
        ),
        Range(min=0, min_open=True, max=MAX_DIST_TIMEOUT_S),
    ] = DEFAULT_DIST_TIMEOUT_S,
    stop_grace: Annotated[
        float,
        Opt(
            help="torchrun: seconds a rank blocked in a collective may stay stuck after "
            "SIGTERM/Ctrl-C before it exits without a new checkpoint. Not a run setting."
        ),
        Range(min=0, min_open=True),
    ] = DEFAULT_STOP_GRACE_S,
    **flags: Any,
) -> None:
    """Train an MoE language model on real text.

    Examples:
      moelab train                          # mix corpus, default model, ~10 min on 2 cores
      moelab train --data shakespeare --experts 16 --top-k 2 --steps 2000
      moelab train --config run.yaml --out runs/exp1
      moelab train --out runs/exp1 --resume
      moelab train --router usmoe --usmoe-budget 0.86
      moelab train --top-k 1 --score-func sigmoid --norm-topk-prob
      moelab train --spec-loss --cross-loss --spec-coeff 0.001 --cross-coeff 0.01
      moelab train --objective block-diffusion --block-size 8 --init-from runs/main
      torchrun --nproc-per-node 2 -m moelab.cli train --steps 100
      moelab train --steps 1000 --expand-at 450 --expand hidden=2x,expert=2x
      torchrun --nproc-per-node 4 -m moelab.cli train --expert-parallel 2 --fsdp
      torchrun --nproc-per-node 2 -m moelab.cli train --expert-parallel 2 --dist-timeout 120
      moelab train --device cuda --steps 5000     # one GPU
    """
    from moelab.train.expand import parse_expand
    from moelab.train.loop import read_run_info
    from moelab.train.loop import train as train_run

    run_dir = out or Path("runs") / name
    model_flags = {o.flag: flags.get(o.flag) for o in MODEL_OPTIONS}
    train_flags = {o.flag: flags.get(o.flag) for o in TRAIN_OPTIONS}
    if expand is not None:
        grow = guarded(parse_expand, expand)
        train_flags.update(expand_hidden=grow.get("hidden"), expand_expert=grow.get("expert"))
    if (
        train_flags.get("block_size") is not None
        and not config
        and train_flags.get("objective") in (None, "causal")
    ):
        fail(InvalidValueError("--block-size: only applies with --objective block-diffusion"))
    if allow_data_change and not resume:
        fail(InvalidValueError("--allow-data-change: only applies with --resume"))
    given = [k for k, v in {**model_flags, **train_flags}.items() if v is not None]
    if resume and (given or config or dense):
        fail(
            InvalidValueError(
                f"--resume continues with the run's saved settings; drop {_flag_names(given, config, dense)}"
            )
        )
    arch = [k for k, v in model_flags.items() if v is not None]
    init_from = train_flags["init_from"]
    if init_from and (arch or dense):
        fail(
            InvalidValueError(
                f"--init-from takes the model from {init_from}; drop {_flag_names(arch, None, dense)}"
            )
        )
    if resume:
        guarded(check_not_store, run_dir)
    model_cfg, train_cfg = (
        (None, None) if resume else guarded(build_configs, config, model_flags, train_flags, dense)
    )
    parallel = None
    if expert_parallel is not None or fsdp:
        from moelab.parallel import ExpertParallel

        parallel = guarded(ExpertParallel, expert_parallel or 1, fsdp)
    result = guarded(
        train_run, model_cfg, train_cfg, run_dir, resume=resume, progress=progress,
        allow_data_change=allow_data_change, parallel=parallel, device=device,
        dist_timeout_s=dist_timeout, stop_grace_s=stop_grace,
    )  # fmt: skip
    if result is None:
        return
    if result.interrupted:
        console.print(
            f"[yellow]interrupted at step {result.step}; checkpoint saved.[/] "
            f"Continue with: moelab train --out {run_dir} --resume"
        )
        raise typer.Exit(code=130)
    if result.final_eval is not None:
        console.print(
            summary_table(f"{run_dir}: validation after {result.step} steps", result.final_eval)
        )
    fits = read_run_info(run_dir).get("budget_fits")
    if fits:
        times = ", ".join(f"{f['step_s']:.3f}" for f in fits)
        console.print(
            f"steps fitted to the time budget: {fits[-1]['steps']} of "
            f"{fits[0]['requested_steps']} (fits at steps "
            f"{', '.join(str(f['at_step']) for f in fits)}: {times} s per step)"
        )
    console.print(f"run saved to {run_dir} ({result.elapsed_s:.0f} s)")


train = app.command(name="train")(
    with_options(
        train,
        option_parameters(ModelConfig, MODEL_OPTIONS),
        option_parameters(TrainConfig, TRAIN_OPTIONS),
    )
)


def _flag_names(names: list[str], config: Path | None, dense: bool) -> str:
    """CLI spellings of the given option names."""
    flags = ["--" + n.replace("_", "-") for n in names]
    return " ".join(flags + (["--config"] if config else []) + (["--dense"] if dense else []))
