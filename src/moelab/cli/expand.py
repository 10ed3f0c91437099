"""``moelab expand``: grow a run's width offline (SPARKLING); training then resumes from DIR."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moelab.cli._app import Opt, app, console, guarded
from moelab.cli._ranges import Range


@app.command()
def expand(
    run: Annotated[Path, typer.Argument(help="Run folder with a checkpoint (model + optimizer).")],
    out: Annotated[Path, Opt(help="New run folder to write.")],
    hidden: Annotated[str | None, Opt(help="Hidden-size factor, e.g. 2x.")] = None,
    expert: Annotated[str | None, Opt(help="Expert / FFN inner-size factor, e.g. 2x.")] = None,
    init: Annotated[
        str, Opt(help="sparkling (the paper's copy-copy init), random, naive or copy.")
    ] = "sparkling",
    state: Annotated[
        str, Opt(help="Optimizer state: asymmetric (the paper's), scaled or symmetric.")
    ] = "asymmetric",
    rewarm_steps: Annotated[
        int | None,
        Opt(
            help="Steps the new entries' LR rises to --rewarm-ratio x (default 0.8 % of the rest, <= 250)."
        ),
        Range(min=0),
    ] = None,
    rewarm_ratio: Annotated[
        float,
        Opt(help="Re-warmup peak of the new entries over the LR at the expansion."),
        Range(min=0, min_open=True),
    ] = 1.3,
    rewarm_tail: Annotated[
        str,
        Opt(
            help="After the re-warmup: base (fall back onto the old entries' schedule) or own (their own cosine to the end)."
        ),
    ] = "base",
) -> None:
    """Grow the width of RUN's latest checkpoint (model and optimizer state) into --out.

    Examples:
      moelab expand runs/small --hidden 2x --out runs/wide
      moelab expand runs/small --expert 2x --init copy --state symmetric --out runs/wide-copy
      moelab expand runs/small --hidden 2x --rewarm-steps 250 --rewarm-ratio 1.3 --out runs/w2
      moelab train --out runs/wide --resume
    """
    from moelab.train.expand import parse_factor
    from moelab.train.expand_run import expand_run

    h = guarded(parse_factor, hidden, "--hidden") if hidden is not None else None
    e = guarded(parse_factor, expert, "--expert") if expert is not None else None
    res = guarded(
        expand_run,
        run,
        out,
        hidden=h,
        inner=e,
        init=init,
        state=state,
        rewarm_steps=rewarm_steps,
        rewarm_ratio=rewarm_ratio,
        rewarm_tail=rewarm_tail,
    )
    table = Table(title=f"{run} → {res.out} at step {res.step} ({res.spec.init}, {res.spec.state})")
    for col in ("", "d_model", "heads", "kv heads", "inner"):
        table.add_column(col, justify="right")
    for label, c in (("before", res.old), ("after", res.new)):
        inner = c.moe.experts.ffn_hidden_size if c.moe is not None else c.dense_ffn_size
        table.add_row(label, str(c.d_model), str(c.n_heads), str(c.n_kv_heads), str(inner))
    console.print(table)
    console.print(f"continue with: moelab train --out {res.out} --resume")
