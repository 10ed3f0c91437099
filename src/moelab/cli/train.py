"""``moelab train``: train an MoE (or dense twin) language model on real text."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from moelab.cli._app import Opt, app, console, fail, guarded
from moelab.cli._common import summary_table


def _model_overrides(**flags: Any) -> dict[str, Any]:
    moe = {
        "router": {
            "num_experts": flags["experts"],
            "top_k": flags["top_k"],
            "kind": flags["router"],
            "score_func": flags["score_func"],
            "capacity_factor": flags["capacity_factor"],
            "expert_bias": flags["expert_bias"],
            "bias_update_rate": flags["bias_rate"],
            "usmoe_rate": flags.get("usmoe_rate"),
            "budget_fraction": flags.get("usmoe_budget"),
            "selection_scope": flags.get("usmoe_scope"),
            "usmoe_weight_norm": flags.get("usmoe_weight_norm"),
        },
        "experts": {
            "ffn_hidden_size": flags["expert_ffn"],
            "shared_expert_size": flags["shared_expert"],
        },
        "losses": {
            "load_balance": flags["aux_loss"],
            "aux_loss_coeff": flags["aux_coeff"],
            "z_loss_coeff": flags["z_coeff"],
            "specialization": flags.get("spec_loss"),
            "specialization_coeff": flags.get("spec_coeff"),
            "cross_layer": flags.get("cross_loss"),
            "cross_layer_coeff": flags.get("cross_coeff"),
            "cross_layer_variant": flags.get("cross_variant"),
        },
    }
    return {
        "d_model": flags["d_model"],
        "n_layers": flags["layers"],
        "n_heads": flags["heads"],
        "n_kv_heads": flags["kv_heads"],
        "first_dense_layers": flags["first_dense"],
        "moe": moe,
    }


def build_configs(
    config_file: Path | None, model_flags: dict[str, Any], train_flags: dict[str, Any], dense: bool
):
    """defaults < ``--config`` file < explicit flags. Returns (ModelConfig, TrainConfig).

    Raises:
        ConfigError / ValueError: a bad file or value, naming the field.
    """
    from moelab.models import ModelConfig, dense_twin_config
    from moelab.train.config import ConfigError, TrainConfig, read_config_file
    from moelab.train.presets import default_model_dict, merge

    file_cfg = read_config_file(config_file) if config_file else {}
    train_dict = merge(TrainConfig().to_dict(), file_cfg.get("train", {}))
    train_cfg = TrainConfig.from_dict(merge(train_dict, train_flags, skip_none=True))
    model_dict = merge(default_model_dict(), file_cfg.get("model", {}))
    model_dict = merge(model_dict, _model_overrides(**model_flags), skip_none=True)
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


@app.command()
def train(
    data: Annotated[
        str | None, Opt(help="Corpus: mix, stdlib, shakespeare, kjv, or a file/folder/glob.")
    ] = None,
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
    init_from: Annotated[
        str | None, Opt(help="Start from a model folder (e.g. made by `moelab upcycle`).")
    ] = None,
    d_model: Annotated[int | None, Opt(help="Model width D.")] = None,
    layers: Annotated[int | None, Opt(help="Decoder layers.")] = None,
    heads: Annotated[int | None, Opt(help="Attention heads.")] = None,
    kv_heads: Annotated[int | None, Opt(help="Key/value heads (GQA).")] = None,
    experts: Annotated[int | None, Opt(help="Routed experts E.")] = None,
    top_k: Annotated[int | None, Opt(help="Experts per token k.")] = None,
    expert_ffn: Annotated[int | None, Opt(help="Hidden width F of each expert.")] = None,
    shared_expert: Annotated[
        int | None, Opt(help="Hidden width of a shared expert (0 = none).")
    ] = None,
    first_dense: Annotated[int | None, Opt(help="First n layers dense (DeepSeek style).")] = None,
    router: Annotated[str | None, Opt(help="token_choice, expert_choice or usmoe.")] = None,
    usmoe_budget: Annotated[
        float | None, Opt(help="USMoE: routed pairs as a fraction of T·k (per sequence).")
    ] = None,
    usmoe_rate: Annotated[float | None, Opt(help="USMoE: r of the unified score.")] = None,
    usmoe_scope: Annotated[
        str | None,
        Opt(help="USMoE selection: position (default), causal_prefix, sequence or batch."),
    ] = None,
    usmoe_weight_norm: Annotated[
        str | None, Opt(help="USMoE combine weights: none, all_experts or selected.")
    ] = None,
    score_func: Annotated[str | None, Opt(help="softmax or sigmoid router scores.")] = None,
    capacity_factor: Annotated[
        float | None, Opt(help="Expert capacity factor (default dropless).")
    ] = None,
    aux_loss: Annotated[
        str | None, Opt(help="Load-balancing loss: switch, seq, global or none.")
    ] = None,
    aux_coeff: Annotated[float | None, Opt(help="Load-balancing loss coefficient.")] = None,
    z_coeff: Annotated[float | None, Opt(help="Router z-loss coefficient.")] = None,
    expert_bias: Annotated[
        bool | None, Opt(help="Aux-loss-free bias balancing (DeepSeek-V3).")
    ] = None,
    bias_rate: Annotated[float | None, Opt(help="Bias update rate γ.")] = None,
    spec_loss: Annotated[
        bool | None, Opt(help="Specialization loss between co-activated experts.")
    ] = None,
    spec_coeff: Annotated[float | None, Opt(help="Specialization loss coefficient.")] = None,
    cross_loss: Annotated[
        bool | None, Opt(help="Cross-layer dependency loss between adjacent MoE layers.")
    ] = None,
    cross_coeff: Annotated[float | None, Opt(help="Cross-layer loss coefficient.")] = None,
    cross_variant: Annotated[str | None, Opt(help="Cross-layer loss: pathway or token.")] = None,
    steps: Annotated[int | None, Opt(help="Optimizer steps.")] = None,
    batch_size: Annotated[int | None, Opt(help="Sequences per micro-batch.")] = None,
    seq_len: Annotated[int | None, Opt(help="Context length.")] = None,
    grad_accum: Annotated[int | None, Opt(help="Micro-batches per step.")] = None,
    lr: Annotated[float | None, Opt(help="Peak learning rate.")] = None,
    warmup_steps: Annotated[int | None, Opt(help="Warmup steps.")] = None,
    weight_decay: Annotated[float | None, Opt(help="AdamW weight decay.")] = None,
    grad_clip: Annotated[float | None, Opt(help="Gradient clipping norm (0 = off).")] = None,
    eval_every: Annotated[int | None, Opt(help="Steps between validations.")] = None,
    eval_tokens: Annotated[int | None, Opt(help="Validation tokens per evaluation.")] = None,
    checkpoint_every: Annotated[int | None, Opt(help="Steps between checkpoints.")] = None,
    log_every: Annotated[int | None, Opt(help="Steps between metrics.jsonl lines.")] = None,
    val_fraction: Annotated[float | None, Opt(help="Fraction of documents held out.")] = None,
    min_lr_ratio: Annotated[float | None, Opt(help="Final lr / peak lr of the cosine.")] = None,
    beta1: Annotated[float | None, Opt(help="AdamW β1.")] = None,
    beta2: Annotated[float | None, Opt(help="AdamW β2.")] = None,
    adam_eps: Annotated[float | None, Opt(help="AdamW ε.")] = None,
    tokenizer: Annotated[str | None, Opt(help="byte or bpe.")] = None,
    bpe_vocab_size: Annotated[int | None, Opt(help="BPE vocabulary size.")] = None,
    max_bytes_per_domain: Annotated[int | None, Opt(help="Cap per corpus domain, bytes.")] = None,
    time_budget: Annotated[float | None, Opt(help="Stop after this many seconds.")] = None,
    seed: Annotated[int | None, Opt(help="Random seed.")] = None,
    allow_noncausal_routing: Annotated[
        bool | None, Opt(help="Allow USMoE scopes that look at future tokens (not a causal LM).")
    ] = None,
    objective: Annotated[
        str | None, Opt(help="causal or block-diffusion (masked block diffusion, +1 mask id).")
    ] = None,
    block_size: Annotated[int | None, Opt(help="Diffusion block size (divides --seq-len).")] = None,
    progress: Annotated[bool, Opt(help="Show the progress bar.")] = True,
) -> None:
    """Train an MoE language model on real text.

    Examples:
      moelab train                          # mix corpus, default model, ~10 min on 2 cores
      moelab train --data shakespeare --experts 16 --top-k 2 --steps 2000
      moelab train --config run.yaml --out runs/exp1
      moelab train --out runs/exp1 --resume
      moelab train --router usmoe --usmoe-budget 0.86
      moelab train --spec-loss --cross-loss --spec-coeff 0.01 --cross-coeff 0.01
      moelab train --objective block-diffusion --block-size 8 --init-from runs/main
      torchrun --nproc-per-node 2 -m moelab.cli train --steps 100
    """
    from moelab.train.loop import train as train_run

    run_dir = out or Path("runs") / name
    model_flags = dict(
        d_model=d_model, layers=layers, heads=heads, kv_heads=kv_heads, experts=experts, top_k=top_k,
        expert_ffn=expert_ffn, shared_expert=shared_expert, first_dense=first_dense, router=router,
        score_func=score_func, capacity_factor=capacity_factor, aux_loss=aux_loss, aux_coeff=aux_coeff,
        z_coeff=z_coeff, expert_bias=expert_bias, bias_rate=bias_rate, usmoe_budget=usmoe_budget,
        usmoe_rate=usmoe_rate, usmoe_scope=usmoe_scope, usmoe_weight_norm=usmoe_weight_norm,
        spec_loss=spec_loss, spec_coeff=spec_coeff, cross_loss=cross_loss, cross_coeff=cross_coeff,
        cross_variant=cross_variant,
    )  # fmt: skip
    train_flags = dict(
        data=data, steps=steps, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum, lr=lr,
        warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip, eval_every=eval_every,
        eval_tokens=eval_tokens, checkpoint_every=checkpoint_every, log_every=log_every, tokenizer=tokenizer,
        bpe_vocab_size=bpe_vocab_size, max_bytes_per_domain=max_bytes_per_domain,
        time_budget_s=time_budget, seed=seed, init_from=init_from, val_fraction=val_fraction,
        min_lr_ratio=min_lr_ratio, beta1=beta1, beta2=beta2, eps=adam_eps,
        allow_noncausal_routing=allow_noncausal_routing, objective=objective, block_size=block_size,
    )  # fmt: skip
    given = [k for k, v in {**model_flags, **train_flags}.items() if v is not None]
    if resume and (given or config or dense):
        fail(
            ValueError(
                f"--resume continues with the run's saved settings; drop {_flag_names(given, config, dense)}"
            )
        )
    arch = [k for k, v in model_flags.items() if v is not None]
    if init_from and (arch or dense):
        fail(
            ValueError(
                f"--init-from takes the model from {init_from}; drop {_flag_names(arch, None, dense)}"
            )
        )
    model_cfg, train_cfg = (
        (None, None) if resume else guarded(build_configs, config, model_flags, train_flags, dense)
    )
    result = guarded(train_run, model_cfg, train_cfg, run_dir, resume=resume, progress=progress)
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
    console.print(f"run saved to {run_dir} ({result.elapsed_s:.0f} s)")


def _flag_names(names: list[str], config: Path | None, dense: bool) -> str:
    """CLI spellings of the given option names (``time_budget_s`` is ``--time-budget``)."""
    spelled = {"time_budget_s": "time_budget", "eps": "adam_eps"}
    flags = ["--" + spelled.get(n, n).replace("_", "-") for n in names]
    return " ".join(flags + (["--config"] if config else []) + (["--dense"] if dense else []))
