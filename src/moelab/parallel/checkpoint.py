"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), loadable at another
EP size or world size, and their conversion to a normal moelab model / run folder.

Layout inside a run folder (same ``checkpoints/latest.json`` index as single-process runs)::

    checkpoints/step-000200/   .metadata, __<rank>_0.distcp   DCP: {"model": ..., "optim": ...}
                               layout.json      {"format": "moelab-dcp", "format_version": 1,
                                                 "world_size", "expert_parallel", "fsdp", "step"}
                               config.json      the model config (moelab.models.io format)
                               trainer_state.pt step, RNG, per-rank batch-sampler state, ...
    checkpoints/latest.json    {"format_version": 1, "step": 200, "dir": "step-000200"}

What DCP stores is the *global* tensor of every state-dict entry: expert and head shards are
wrapped as DTensors on the ``("dp", "ep")`` mesh with placements ``[Replicate(), Shard(0)]``
(or, when FSDP2 split them over their DP group, on the ``("ep", "dp")`` mesh with
``[Shard(0), Shard(0)]``), the other FSDP2 parameters are DTensors already, replicated tensors are plain (written once). Loading
builds the same wrapped dict for the *loading* layout and DCP reads each rank's slice, so a
checkpoint written at EP=4 loads at EP=2, at EP=1 and in a single process.

Optimizer state (AdamW ``step``, ``exp_avg``, ``exp_avg_sq``) is stored per parameter name,
sharded like its parameter; hyperparameters come from the run's TrainConfig, not the
checkpoint (choice). The folder is written under a temporary name and renamed by rank 0 after
every rank finished, and ``latest.json`` is replaced atomically afterwards, so an interrupted
save never becomes the latest checkpoint; the two newest are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard

from moelab.models import CheckpointError, ModelConfig, MoETransformer, save_model
from moelab.models.io import CONFIG_FILE, FORMAT_VERSION, MANIFEST_FILE, load_config
from moelab.parallel.comm import ParallelGroups
from moelab.utils.atomic import (
    atomic_write,
    atomic_write_json,
    fsync_dir,
    write_folder_atomically,
)
from moelab.utils.jsonfile import read_json
from moelab.utils.outdir import check_output_folder

LAYOUT_FILE = "layout.json"
STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest.json"
LAYOUT_FORMAT = "moelab-dcp"
KEEP = 2


def _wrap(t: Tensor, name: str, sharded: set[str], groups: ParallelGroups) -> Tensor:
    if name not in sharded or groups.ep == 1:
        return t
    if isinstance(t, DTensor):  # FSDP2 split this EP shard over its DP group (dim 0)
        shape = (t.shape[0] * groups.ep, *t.shape[1:])
        return DTensor.from_local(
            t.to_local(),
            groups.expert_mesh,
            [Shard(0), Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return DTensor.from_local(t, groups.mesh, [Replicate(), Shard(0)], run_check=False)


def model_state(model: nn.Module, sharded: set[str], groups: ParallelGroups) -> dict[str, Tensor]:
    """``model.state_dict()`` with EP shards as global DTensors (views of the local shards)."""
    return {k: _wrap(v, k, sharded, groups) for k, v in model.state_dict().items()}


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's lazily-made state (zeros, step 0) so DCP has tensors to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state or not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, sharded: set[str], groups: ParallelGroups
) -> dict[str, dict[str, Tensor]]:
    """Per-parameter-name optimizer state, shards wrapped like :func:`model_state`."""
    _init_adam_state(optimizer)
    out = {}
    for name, p in model.named_parameters():
        if p in optimizer.state:
            st = optimizer.state[p]
            out[name] = {
                k: _wrap(v, name, sharded, groups) if v.dim() else v for k, v in st.items()
            }
    return out


def _barrier(groups: ParallelGroups) -> None:
    if groups.enabled:
        dist.barrier()


def save_sharded(
    run_dir: Path,
    model: MoETransformer,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    step: int,
    sharded: list[str],
    groups: ParallelGroups,
    fsdp: bool = False,
) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it). Returns the folder."""
    keep = set(sharded)
    root = Path(run_dir) / "checkpoints"
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f".{name}.tmp"
    main = groups.rank == 0
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(groups)
    state = {
        "model": model_state(model, keep, groups),
        "optim": optimizer_state(model, optimizer, keep, groups),
    }
    dcp.save(state, checkpoint_id=tmp)
    _barrier(groups)
    if main:
        atomic_write(tmp / STATE_FILE, lambda p: torch.save(trainer_state, p))
        atomic_write_json(
            tmp / CONFIG_FILE, {"format_version": FORMAT_VERSION, "model": model.cfg.to_dict()}
        )
        layout = {
            "format": LAYOUT_FORMAT,
            "format_version": 1,
            "world_size": groups.world_size,
            "expert_parallel": groups.ep,
            "fsdp": fsdp,
            "step": step,
        }
        atomic_write_json(tmp / LAYOUT_FILE, layout)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
        atomic_write_json(root / LATEST_FILE, {"format_version": 1, "step": step, "dir": name})
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(groups)
    return final


def read_layout(folder: Path) -> dict[str, Any]:
    """The ``layout.json`` of a sharded checkpoint folder.

    Raises:
        CheckpointError: missing (not a sharded checkpoint), malformed or newer.
    """
    path = Path(folder) / LAYOUT_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: not a sharded (DCP) checkpoint (no {LAYOUT_FILE}); it was written by a "
            "single-process run, resume it without --expert-parallel/--fsdp"
        )
    layout = read_json(path, CheckpointError)
    if not isinstance(layout, dict) or layout.get("format") != LAYOUT_FORMAT:
        raise CheckpointError(f"{path}: not a moelab sharded-checkpoint layout")
    if layout.get("format_version", 0) > 1:
        raise CheckpointError(f"{path}: written by a newer moelab")
    return layout


def latest_sharded_dir(run_dir: Path) -> Path | None:
    """The folder ``checkpoints/latest.json`` names, or None when the run has none."""
    latest = Path(run_dir) / "checkpoints" / LATEST_FILE
    if not latest.exists():
        return None
    info = read_json(latest, CheckpointError)
    if not isinstance(info, dict) or not isinstance(info.get("dir"), str):
        raise CheckpointError(f"{latest}: corrupt checkpoint index")
    return latest.parent / info["dir"]


def load_sharded(
    folder: Path,
    model: nn.Module,
    sharded: list[str],
    groups: ParallelGroups,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model`` (sharded for *this* layout) and, when given,
    ``optimizer``, in place; collective. Returns the trainer state (``{}`` if absent).

    Raises:
        CheckpointError: not a sharded checkpoint, or its tensors do not fit the model
            (another architecture), naming the folder.
    """
    folder = Path(folder)
    read_layout(folder)
    keep = set(sharded)
    state: dict[str, Any] = {"model": model_state(model, keep, groups)}
    if optimizer is not None:
        state["optim"] = optimizer_state(model, optimizer, keep, groups)
    try:
        dcp.load(state, checkpoint_id=folder)
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        cause = _first_failure(e)
        if isinstance(cause, FileNotFoundError):
            raise CheckpointError(
                f"{folder}: shard file {Path(cause.filename).name} is missing (an incomplete "
                "copy of the checkpoint?)"
            ) from e
        first = str(cause).strip().splitlines()
        raise CheckpointError(
            f"{folder}: does not fit this model "
            f"({type(cause).__name__}: {first[0] if first else ''})"
        ) from e
    path = folder / STATE_FILE
    if not path.is_file():
        return {}
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: corrupt or truncated ({type(e).__name__})") from e


def _first_failure(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (else ``exc``)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


CONSOLIDATED_FILE = "consolidated.json"
"""Written by :func:`consolidate` into its output: ``{"source": checkpoint folder, "step": N}``."""


def consolidate(folder: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Convert a sharded checkpoint (or a run folder: its latest one) into a normal model folder
    (``config.json``, ``model.safetensors``, ``manifest.json``) in one process; with a run
    folder the tokenizer and ``run.json`` are copied too, so ``out`` is a normal run folder.
    ``out`` also gets :data:`CONSOLIDATED_FILE`, naming the checkpoint and its step. The
    folder is written as a whole under the output-folder rules
    (:func:`moelab.utils.outdir.check_output_folder`).

    Raises:
        CheckpointError: no sharded checkpoint there, or a finished run (its final model is
            already a normal model folder: the run folder itself; its latest checkpoint may
            be an earlier step); OutputFolderError: ``out`` is, surrounds or lies inside the
            source, or is not empty (``OutputExistsError``, a FileExistsError).
    """
    folder, out = Path(folder), Path(out)
    source = folder
    run_dir = None
    if (folder / "checkpoints").is_dir():
        run_dir = folder
        if (folder / MANIFEST_FILE).is_file():
            raise CheckpointError(
                f"{folder}: the run finished, and its final model is this folder itself (load "
                "it directly); to consolidate an earlier step, name its checkpoint folder "
                f"({folder / 'checkpoints'}/step-N)"
            )
        ckpt = latest_sharded_dir(folder)
        if ckpt is None:
            raise CheckpointError(f"{folder}: the run has no checkpoint")
        folder = ckpt
    layout = read_layout(folder)
    check_output_folder(out, inputs=[source], flag=None)
    cfg: ModelConfig = load_config(folder)
    model = MoETransformer(cfg)
    load_sharded(folder, model, [], ParallelGroups())

    def fill(tmp: Path) -> None:
        save_model(model, tmp)
        if run_dir is not None:
            for name in os.listdir(run_dir):
                src = run_dir / name
                if src.is_file() and (name.startswith("tokenizer") or name == "run.json"):
                    shutil.copy2(src, tmp / name)
        record = {"source": str(folder.resolve()), "step": layout.get("step")}
        atomic_write_json(tmp / CONSOLIDATED_FILE, record)

    write_folder_atomically(out, fill, inputs=[source], flag=None)
    return out
