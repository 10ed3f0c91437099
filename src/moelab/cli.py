"""``moelab`` command line: thin wrappers that parse options and call library functions."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from moelab.data import DataError
from moelab.interop.cli import convert_command
from moelab.models import CheckpointError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="moelab: train, evaluate, analyse and serve Mixture-of-Experts language models.",
)
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True, highlight=False)

USER_ERRORS = (
    DataError,
    CheckpointError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    FloatingPointError,
)


def _fail(exc: BaseException) -> None:
    err_console.print(
        f"[bold red]error:[/] {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    )
    raise typer.Exit(code=2)


def _run(fn, *args, **kwargs):
    """Call ``fn``; a user error becomes one red line and exit code 2 (no traceback)."""
    try:
        return fn(*args, **kwargs)
    except USER_ERRORS as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err_console.print("[yellow]aborted[/]")
        raise typer.Exit(code=130) from None


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


def _summary_table(title: str, result) -> Table:
    table = Table(title=title)
    for col in ("slice", "loss (nats/token)", "perplexity", "bits/byte", "tokens"):
        table.add_column(col, justify="right" if col != "slice" else "left")
    rows = [("all", result.overall), *sorted(result.per_domain.items())]
    for name, s in rows:
        table.add_row(
            name, f"{s.loss:.4f}", f"{s.perplexity:.2f}", f"{s.bits_per_byte:.4f}", f"{s.tokens:,}"
        )
    return table


Opt = typer.Option


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
        str | None, Opt(help="USMoE selection: sequence, batch or causal_prefix.")
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
    )  # fmt: skip
    given = [k for k, v in {**model_flags, **train_flags}.items() if v is not None]
    if resume and (given or config or dense):
        _fail(
            ValueError(
                f"--resume continues with the run's saved settings; drop {_flag_names(given, config, dense)}"
            )
        )
    arch = [k for k, v in model_flags.items() if v is not None]
    if init_from and (arch or dense):
        _fail(
            ValueError(
                f"--init-from takes the model from {init_from}; drop {_flag_names(arch, None, dense)}"
            )
        )
    model_cfg, train_cfg = (
        (None, None) if resume else _run(build_configs, config, model_flags, train_flags, dense)
    )
    result = _run(train_run, model_cfg, train_cfg, run_dir, resume=resume, progress=progress)
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
            _summary_table(f"{run_dir}: validation after {result.step} steps", result.final_eval)
        )
    console.print(f"run saved to {run_dir} ({result.elapsed_s:.0f} s)")


def _flag_names(names: list[str], config: Path | None, dense: bool) -> str:
    """CLI spellings of the given option names (``time_budget_s`` is ``--time-budget``)."""
    spelled = {"time_budget_s": "time_budget", "eps": "adam_eps"}
    flags = ["--" + spelled.get(n, n).replace("_", "-") for n in names]
    return " ".join(flags + (["--config"] if config else []) + (["--dense"] if dense else []))


def _load_run(run: Path):
    """A run/model folder, or a named pretrained model (e.g. ``smollm2``)."""
    from moelab.data import load_tokenizer
    from moelab.models import load_model
    from moelab.models.pretrained import PRETRAINED, load_pretrained

    if not run.is_dir():
        if str(run) in PRETRAINED:
            return load_pretrained(str(run))
        raise FileNotFoundError(f"{run}: run folder not found")
    if (run / "run.json").exists() and not (run / "model.safetensors").exists():
        raise CheckpointError(
            f"{run}: the run has not finished; continue it with: moelab train --out {run} --resume"
        )
    return load_model(run), load_tokenizer(run)


@app.command("eval")
def eval_cmd(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    data: Annotated[
        str | None, Opt(help="Corpus to score (default: the run's validation split).")
    ] = None,
    tokens: Annotated[int, Opt(help="Maximum tokens to score.")] = 262_144,
    batch_size: Annotated[int, Opt(help="Sequences per batch.")] = 16,
    as_json: Annotated[bool, Opt("--json", help="Print JSON.")] = False,
) -> None:
    """Loss, perplexity and bits per byte of a run (per domain for the mix corpus).

    Examples:
      moelab eval runs/main
      moelab eval runs/main --data kjv --json
    """
    result = _run(_evaluate_run, run, data, tokens, batch_size)
    if as_json:
        console.print_json(json.dumps(result.to_dict()))
    else:
        console.print(
            _summary_table(f"{run}: {'validation split' if data is None else data}", result)
        )


def _evaluate_run(run: Path, data: str | None, tokens: int, batch_size: int):
    from moelab.data import TokenStream, load_corpus
    from moelab.train.evaluate import evaluate
    from moelab.train.loop import prepare_data, run_train_config

    model, tokenizer = _load_run(run)
    cfg = run_train_config(run)
    seq_len = min(cfg.seq_len, model.cfg.max_seq_len)
    if data is None:
        _, _, streams = prepare_data(cfg, tokenizer)
    else:
        streams = {data: TokenStream.from_documents(load_corpus(data), tokenizer, name=data)}
    return evaluate(model, streams, seq_len=seq_len, batch_size=batch_size, max_tokens=tokens)


@app.command()
def generate(
    run: Annotated[
        Path, typer.Argument(help="Run folder, model folder, or a pretrained name (smollm2).")
    ],
    prompt: Annotated[str, Opt(help="Text to continue.")] = "\n",
    max_new_tokens: Annotated[int, Opt(help="Tokens to generate.")] = 200,
    temperature: Annotated[float, Opt(help="Sampling temperature (0 = greedy).")] = 0.8,
    top_k: Annotated[int, Opt(help="Keep the k most likely tokens (0 = off).")] = 50,
    top_p: Annotated[float, Opt(help="Nucleus probability mass (1 = off).")] = 0.95,
    seed: Annotated[int, Opt(help="Sampling seed.")] = 0,
) -> None:
    """Continue a prompt, streaming tokens as they are sampled.

    Examples:
      moelab generate runs/main --prompt "ROMEO:" --max-new-tokens 300
      moelab generate runs/main --prompt "def main(" --temperature 0
    """
    from moelab.serve.generate import generate_ids, stream_text

    model, tokenizer = _run(_load_run, run)

    def go() -> None:
        prompt_ids = tokenizer.encode(prompt)
        ids = generate_ids(
            model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k or None, top_p=top_p, seed=seed, stop_id=tokenizer.eot_id,
        )  # fmt: skip
        counted = _Counted(ids)
        sys.stdout.write(prompt)
        for piece in stream_text(tokenizer, counted):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if counted.n < max_new_tokens and len(prompt_ids) + counted.n >= model.cfg.max_seq_len:
            err_console.print(
                f"[yellow]stopped after {counted.n} tokens: the context holds {model.cfg.max_seq_len}[/]"
            )

    _run(go)


app.command("convert")(convert_command)


@app.command()
def analyze(
    run: Annotated[
        Path, typer.Argument(help="Run folder or model folder (e.g. an imported HF MoE).")
    ],
    data: Annotated[
        str | None, Opt(help="Corpus to route (default: the run's validation split).")
    ] = None,
    tokens: Annotated[int, Opt(help="Tokens per domain to route.")] = 32_768,
    batch_size: Annotated[int, Opt(help="Sequences per batch.")] = 8,
    seq_len: Annotated[int | None, Opt(help="Context length (default: the run's).")] = None,
    out: Annotated[Path | None, Opt(help="Output folder (default RUN/analysis).")] = None,
) -> None:
    """Routing analysis: load, confidence, co-activation, pathways, specialisation, rank.

    Writes analysis.json, PNG plots and a self-contained report.html.

    Examples:
      moelab analyze runs/main
      moelab analyze runs/main --data shakespeare --tokens 8192 --out /tmp/an
    """
    from rich.progress import Progress

    model, tokenizer = _run(_load_run, run)
    streams, cfg_seq_len = _run(_analysis_streams, run, data, tokenizer)
    if seq_len is not None and seq_len < 1:
        _fail(ValueError(f"seq_len: must be >= 1, got {seq_len}"))
    seq_len = min(seq_len or cfg_seq_len, model.cfg.max_seq_len)
    out = out or run / "analysis"
    if out.exists() and not out.is_dir():
        _fail(NotADirectoryError(f"{out}: exists and is not a folder"))
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("routing validation text", total=None)
        result, pngs = _run(_analyze_to, out, model, streams, seq_len, batch_size, tokens, run,
                            lambda: bar.advance(task))  # fmt: skip
    table = Table(title=f"{run}: routing per MoE layer")
    cols = {
        "layer": "layer", "cv": "CV", "max_over_mean": "max/mean", "num_dead": "dead",
        "entropy": "H nats", "normalized_entropy": "H/lnE", "margin": "margin",
        "adjacent_consistency": "adj", "pathway_nmi_next": "path NMI", "domain_nmi": "dom NMI",
        "effective_rank": "eff rank", "redundancy": "cos",
    }  # fmt: skip
    present = [c for c in cols if any(c in row for row in result["headline"])]
    for c in present:
        table.add_column(cols[c], justify="right")
    for row in result["headline"]:
        table.add_row(*(_fmt(row.get(c)) for c in present))
    console.print(table)
    console.print(f"wrote {out / 'analysis.json'}, {len(pngs)} plots and {out / 'report.html'}")


def _analyze_to(
    out: Path, model, streams, seq_len: int, batch_size: int, tokens: int, run: Path, tick
):
    """Collect routing, compute every metric, write analysis.json, plots and report.html."""
    from moelab.analysis import analyze as analyze_records
    from moelab.analysis import plot_all, write_json, write_report
    from moelab.analysis.collect import collect

    got = collect(
        model, streams, seq_len=seq_len, batch_size=batch_size, max_tokens=tokens, on_batch=tick
    )
    result = analyze_records(
        got.records_by_layer, domains=got.domains, domain_names=got.domain_names,
        hidden_by_layer=got.hidden_by_layer, expert_outputs_by_layer=got.expert_outputs_by_layer,
    )  # fmt: skip
    write_json(result, out / "analysis.json")
    pngs = plot_all(result, out / "plots")
    write_report(result, pngs, out / "report.html", title=f"moelab routing report: {run}")
    return result, pngs


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _analysis_streams(run: Path, data: str | None, tokenizer):
    """The run's validation streams per domain (or ``data`` split by domain) and its seq_len."""
    from moelab.data import TokenStream, load_corpus
    from moelab.train.loop import prepare_data, run_train_config

    cfg = run_train_config(run)
    if data is None:
        return prepare_data(cfg, tokenizer)[2], cfg.seq_len
    docs = load_corpus(data)
    names = sorted({d.domain for d in docs})
    streams = {
        n: TokenStream.from_documents(
            [d for d in docs if d.domain == n], tokenizer, domain_names=names, name=n
        )
        for n in names
    }
    return streams, cfg.seq_len


@app.command()
def upcycle(
    source: Annotated[str, Opt("--from", help="Dense model: 'smollm2' or a dense model folder.")],
    out: Annotated[Path, Opt(help="Run folder to write.")],
    experts: Annotated[int, Opt(help="E: copies of each dense FFN.")] = 8,
    top_k: Annotated[int, Opt(help="k: copies active per token.")] = 2,
    granularity: Annotated[int, Opt(help="G: split each copy into G finer experts.")] = 1,
    seed: Annotated[int, Opt(help="Router initialisation seed.")] = 0,
    force: Annotated[bool, Opt(help="Replace a non-empty --out.")] = False,
) -> None:
    """Sparse upcycling: turn a dense model into an MoE whose output is identical at step 0.

    Examples:
      moelab upcycle --from smollm2 --experts 8 --top-k 2 --out runs/smollm2-moe
      moelab generate runs/smollm2-moe --prompt "The capital of France is" --temperature 0
      moelab train --init-from runs/smollm2-moe --data mix --steps 50 --lr 1e-4 --out runs/smollm2-ft
    """
    from moelab.models.pretrained import PretrainedNotInstalledError
    from moelab.train.upcycle_cli import upcycle_command

    try:
        result = _run(upcycle_command, source, out, experts, top_k, granularity, seed, force=force)
    except PretrainedNotInstalledError as exc:
        _fail(exc)
    p = result.params
    console.print(
        f"upcycled {source} -> {out}: {result.num_experts} experts, {result.top_k} active, "
        f"{p['total'] / 1e6:.1f}M params ({p['active_per_token'] / 1e6:.1f}M active); "
        f"max |logit difference| vs dense {result.max_abs_logit_diff:.2e}"
    )


class _Counted:
    """An iterator wrapper that counts what it yields."""

    def __init__(self, it) -> None:
        self.it, self.n = it, 0

    def __iter__(self):
        for x in self.it:
            self.n += 1
            yield x


def main() -> None:
    app()


if __name__ == "__main__":
    main()
