"""Helpers shared by several commands: loading a run, the validation summary table."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from moelab.models import CheckpointError


def load_run(run: Path, *, edits: bool = False):
    """A run/model folder, a named pretrained model (e.g. ``smollm2``), or, with ``edits``
    (the inference commands: generate, serve, eval), an edit folder of ``moelab edit apply``:
    its base model with the edits applied.

    Returns:
        ``(model, tokenizer)``.
    Raises:
        FileNotFoundError: no such folder or pretrained name.
        InvalidValueError: a lossless expert store (it only serves, with ``--offload``), or
            an edit folder without ``edits`` (its edit layers are not a model checkpoint).
        CheckpointError: an unfinished run, or a corrupt folder.
    """
    from moelab.data import load_tokenizer
    from moelab.errors import InvalidValueError
    from moelab.interop.pretrained import PRETRAINED, load_pretrained
    from moelab.methods.editing.io import is_edit_folder, load_edits, read_edit_state
    from moelab.models import load_model
    from moelab.train.loop import run_finished

    if not run.is_dir():
        if str(run).lower() in PRETRAINED:
            return load_pretrained(str(run), kind="causal_lm")
        raise FileNotFoundError(f"{run}: run folder not found")
    check_not_store(run)
    if is_edit_folder(run):  # `moelab edit apply` output: its base model with the edits
        if not edits:
            raise InvalidValueError(
                f"{run}: an edit folder (moelab edit apply); it loads for generate, serve and "
                "eval only"
            )
        model, tokenizer = load_run(Path(read_edit_state(run)["base"]))
        load_edits(run, model)
        return model, tokenizer
    if (run / "run.json").exists() and not run_finished(run):
        raise CheckpointError(
            f"{run}: the run has not finished; continue it with: moelab train --out {run} --resume"
        )
    return load_model(run), load_tokenizer(run)


def check_not_store(folder: Path) -> None:
    """Refuse a lossless expert store where a run is expected: it carries the run's
    ``run.json`` but no model, so it would pass for an unfinished run (and ``train --resume``
    would train into it).

    Raises:
        InvalidValueError: naming the folder and what to use instead.
    """
    from moelab.compress.lossless.store import is_store
    from moelab.errors import InvalidValueError

    if is_store(folder):
        raise InvalidValueError(
            f"{folder}: a lossless expert store, not a run (it serves with --offload); "
            "use the run it was written from"
        )


def check_source_model(model, run: Path, command: str) -> None:
    """Refuse, before any calibration, a model that ``command`` (prune, quantize) cannot
    transform: a block-diffusion model (calibration runs the causal forward), a quantized
    one (its experts are codes, not weights), or weights holding NaN/inf (every statistic
    would be NaN and the failure would come at the end, naming no NaN).

    Raises:
        InvalidValueError: naming the run and, for NaN/inf, the first such parameter.
    """
    import torch

    from moelab.errors import InvalidValueError
    from moelab.models.quantized import is_quantized

    if model.cfg.objective != "causal":
        raise InvalidValueError(
            f"run: {run} is a {model.cfg.objective} model; {command} works on causal models"
        )
    if is_quantized(model):
        raise InvalidValueError(
            f"run: {run} is already quantized; {command} the full-precision run"
        )
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise InvalidValueError(
                f"run: {run}: the weights hold NaN or inf (first in {name}); {command} needs "
                "finite weights"
            )


def summary_table(title: str, result, reference=None, reference_name=None) -> Table:
    """Loss, perplexity, bits/byte and tokens per slice of an :class:`EvalResult`, with the
    bits/byte of a ``reference`` :class:`EvalResult` (same slices) in a last column."""
    table = Table(title=title)
    cols = ["slice", "loss (nats/token)", "perplexity", "bits/byte", "tokens"]
    if reference is not None:
        cols.append(f"bits/byte of {reference_name}")
    for col in cols:
        table.add_column(col, justify="right" if col != "slice" else "left")
    rows = [("all", result.overall), *sorted(result.per_domain.items())]
    for name, s in rows:
        cells = [
            name,
            f"{s.loss:.4f}",
            f"{s.perplexity:.2f}",
            f"{s.bits_per_byte:.4f}",
            f"{s.tokens:,}",
        ]
        if reference is not None:
            r = reference.overall if name == "all" else reference.per_domain.get(name)
            cells.append(f"{r.bits_per_byte:.4f}" if r is not None else "")
        table.add_row(*cells)
    return table


def write_derived_run(
    out: Path, model, tokenizer, run_info: dict | None, report_file: str, report: dict, source: Path
) -> None:
    """Write a model derived from the run ``source`` (pruned, quantized, ...) as a run folder:
    weights, tokenizer, ``run.json`` (the source's, with the new model config) and the
    command's JSON report, atomically; ``out`` may not be, contain or lie inside ``source``,
    and must be new or empty (the commands have no flag to replace it).

    Raises:
        OutputFolderError: see :func:`moelab.utils.outdir.check_output_folder`.
    """
    from moelab.models import save_model
    from moelab.utils.atomic import atomic_write_json, write_folder_atomically

    def fill(tmp: Path) -> None:
        save_model(model, tmp)
        tokenizer.save(tmp)
        if run_info is not None:
            atomic_write_json(tmp / "run.json", {**run_info, "model": model.cfg.to_dict()})
        atomic_write_json(tmp / report_file, report)

    write_folder_atomically(out, fill, inputs=[source], flag=None)
