"""A trained MoLF arm as a folder: ``flow.json`` (format, config, seed, metrics) and
``model.safetensors`` (the model's weights, the frozen VAE's included).

The slides are not stored: :func:`load_flow_run` rebuilds them from the config and seed (the
same file gives the same split, view and rotations), so the data file must still be there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from moelab.errors import InvalidValueError, UserError
from moelab.methods.flow.config import FlowConfig
from moelab.methods.flow.expression import ExpressionRun, build_model, load_table, make_slides
from moelab.methods.flow.vae import GeneVAE
from moelab.utils.atomic import atomic_write_bytes, atomic_write_json, write_folder_atomically
from moelab.utils.jsonfile import read_json

FORMAT = "moelab.flow/1"
CONFIG_FILE = "flow.json"
WEIGHTS_FILE = "model.safetensors"


class FlowRunError(UserError, ValueError):
    """A flow run folder is missing, of another format, or does not match its weights."""


def save_flow_run(
    run: ExpressionRun, out: str | Path, metrics: dict[str, float], *, overwrite: bool = False
) -> Path:
    """Write ``run`` to the folder ``out`` atomically (output-folder rules of
    :func:`moelab.utils.atomic.write_folder_atomically`)."""
    state = {k: v.detach().contiguous() for k, v in run.model.state_dict().items()}
    meta = {
        "format": FORMAT,
        "seed": run.seed,
        "config": dataclasses.asdict(run.config),
        "metrics": metrics,
    }

    def fill(tmp: Path) -> None:
        atomic_write_bytes(tmp / WEIGHTS_FILE, save_safetensors(state))
        atomic_write_json(tmp / CONFIG_FILE, meta)

    write_folder_atomically(out, fill, overwrite, known_outputs=(CONFIG_FILE, WEIGHTS_FILE))
    return Path(out)


def _config(raw: dict, path: Path) -> FlowConfig:
    fields = {f.name: f for f in dataclasses.fields(FlowConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise FlowRunError(f"{path}: unknown config field {unknown[0]!r}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    try:
        return FlowConfig(**values)
    except InvalidValueError as e:
        raise FlowRunError(f"{path}: {e}") from None


def load_flow_run(folder: str | Path) -> ExpressionRun:
    """The trained arm in ``folder`` (written by :func:`save_flow_run`), in eval mode.

    Raises:
        FlowRunError: no run there, another format, a bad config, or weights that do not fit.
        CorpusError, MissingDependencyError: its data file cannot be read any more.
    """
    folder = Path(folder)
    meta_path = folder / CONFIG_FILE
    if not meta_path.is_file():
        raise FlowRunError(f"{folder}: no {CONFIG_FILE} (not a `moelab flow train` output)")
    meta = read_json(meta_path, FlowRunError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise FlowRunError(f"{meta_path}: not a {FORMAT} file")
    config = _config(meta.get("config", {}), meta_path)
    seed = meta.get("seed")
    if not isinstance(seed, int):
        raise FlowRunError(f"{meta_path}: seed must be an int, got {seed!r}")
    if config.task != "expression":
        raise FlowRunError(f"{meta_path}: only expression runs are saved, got {config.task!r}")
    data = make_slides(load_table(config), config, seed)
    G = data.train.genes.shape[-1]
    vae = None
    if config.velocity != "simplemlp":
        vae = GeneVAE(G, config.vae_hidden, config.latent_size).requires_grad_(False)
    model = build_model(config, data, vae)
    try:
        state = load_safetensors((folder / WEIGHTS_FILE).read_bytes())
        model.load_state_dict(state)
    except FileNotFoundError:
        raise FlowRunError(f"{folder}: no {WEIGHTS_FILE}") from None
    except (RuntimeError, OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FlowRunError(f"{folder / WEIGHTS_FILE}: does not fit its config ({first})") from None
    model.requires_grad_(False).eval()
    return ExpressionRun(config, seed, data, vae.eval() if vae is not None else None, model)
