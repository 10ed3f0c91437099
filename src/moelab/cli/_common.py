"""Helpers shared by several commands: loading a run, the validation summary table."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from moelab.models import CheckpointError


def load_run(run: Path):
    """A run/model folder, or a named pretrained model (e.g. ``smollm2``).

    Returns:
        ``(model, tokenizer)``.
    Raises:
        FileNotFoundError: no such folder or pretrained name.
        CheckpointError: an unfinished run, or a corrupt folder.
    """
    from moelab.data import load_tokenizer
    from moelab.interop.pretrained import PRETRAINED, load_pretrained
    from moelab.models import load_model

    if not run.is_dir():
        if str(run) in PRETRAINED:
            return load_pretrained(str(run))
        raise FileNotFoundError(f"{run}: run folder not found")
    if (run / "run.json").exists() and not (run / "model.safetensors").exists():
        raise CheckpointError(
            f"{run}: the run has not finished; continue it with: moelab train --out {run} --resume"
        )
    return load_model(run), load_tokenizer(run)


def summary_table(title: str, result) -> Table:
    """Loss, perplexity, bits/byte and tokens per slice of an :class:`EvalResult`."""
    table = Table(title=title)
    for col in ("slice", "loss (nats/token)", "perplexity", "bits/byte", "tokens"):
        table.add_column(col, justify="right" if col != "slice" else "left")
    rows = [("all", result.overall), *sorted(result.per_domain.items())]
    for name, s in rows:
        table.add_row(
            name, f"{s.loss:.4f}", f"{s.perplexity:.2f}", f"{s.bits_per_byte:.4f}", f"{s.tokens:,}"
        )
    return table
