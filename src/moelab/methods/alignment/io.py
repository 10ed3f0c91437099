"""An aligned model as an ordinary moelab model folder: the adapters are merged into the
expert weights (:func:`moelab.models.lora.merge_expert_lora`), so ``moelab generate``,
``moelab serve`` and :func:`moelab.models.load_model` load it like any MoE model; beside it,
``align.json`` records the arm, the config, the selected experts and the metrics."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moelab.data.fingerprint import tokenizer_files
from moelab.methods.alignment.config import AlignConfig
from moelab.methods.alignment.recipe import Aligned
from moelab.models.io import save_model
from moelab.models.lora import merge_expert_lora
from moelab.utils.atomic import atomic_write_json, write_folder_atomically

FORMAT = "moelab.align/1"
ALIGN_FILE = "align.json"


def save_aligned(
    run: Aligned,
    cfg: AlignConfig,
    out: str | Path,
    metrics: dict[str, float] | None = None,
    *,
    seed: int = 0,
    overwrite: bool = False,
    inputs: tuple[str | Path, ...] = (),
) -> Path:
    """Write ``run``'s merged model, its tokenizer and ``align.json`` to the folder ``out``
    atomically.

    Raises:
        OutputFolderError / OutputExistsError: ``out`` is an input or holds other files, or
            is not empty without ``overwrite`` (:func:`moelab.utils.outdir.check_output_folder`).
    """
    model = merge_expert_lora(run.model).eval()
    meta = {
        "format": FORMAT,
        "method": "MESA (ICML 2026, arXiv 2606.00651), moelab's reading",
        "arm": cfg.arm,
        "seed": seed,
        "config": dataclasses.asdict(cfg),
        "selection": {str(k): v.to_json() for k, v in run.selection.items()},
        "train": run.train_stats,
        "metrics": metrics or {},
    }

    def fill(tmp: Path) -> None:
        run.tokenizer.save(tmp)  # first, so the manifest checksums the tokenizer files too
        save_model(model, tmp, extra_files=tokenizer_files(tmp))
        atomic_write_json(tmp / ALIGN_FILE, meta, sort_keys=True)

    write_folder_atomically(out, fill, overwrite, inputs=inputs)
    return Path(out)
