"""A trained agent as a folder: moelab's model files (``config.json``, ``model.safetensors``,
``manifest.json``), its BPE tokenizer, and ``agent.json`` (format, recipe config, seed, metrics).

The chains are not stored: :func:`load_agent_run` re-reads them from the config's data path
(None: the shipped set) and re-encodes them with the saved tokenizer.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from moelab.data.tokenizer import BPE_FILE, META_FILE, load_tokenizer
from moelab.errors import InvalidValueError, UserError
from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.data import prepare_data
from moelab.methods.agents.recipe import AgentRun
from moelab.models.io import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, load_model, save_model
from moelab.utils.atomic import atomic_write_json, write_folder_atomically
from moelab.utils.jsonfile import read_json

FORMAT = "moelab.agent/1"
AGENT_FILE = "agent.json"
_OUTPUTS = (AGENT_FILE, BPE_FILE, META_FILE, CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE)


class AgentRunError(UserError, ValueError):
    """An agent run folder is missing, of another format, or has a bad config."""


def save_agent_run(
    run: AgentRun, out: str | Path, seed: int, metrics: dict[str, float], *, overwrite: bool = False
) -> Path:
    """Write ``run`` to the folder ``out`` atomically (the output-folder rules of
    :func:`moelab.utils.atomic.write_folder_atomically`)."""
    meta = {
        "format": FORMAT,
        "seed": seed,
        "config": dataclasses.asdict(run.config),
        "metrics": metrics,
    }

    def fill(tmp: Path) -> None:
        run.data.tokenizer.save(tmp)
        save_model(run.model, tmp, extra_files=(BPE_FILE, META_FILE))
        atomic_write_json(tmp / AGENT_FILE, meta)

    write_folder_atomically(out, fill, overwrite, known_outputs=_OUTPUTS)
    return Path(out)


def load_agent_run(folder: str | Path) -> tuple[AgentRun, int]:
    """The agent in ``folder`` (from :func:`save_agent_run`) in eval mode, and its seed.

    Raises:
        AgentRunError: no run there, another format or a bad config.
        CheckpointError, TokenizerError: damaged model or tokenizer files.
    """
    folder = Path(folder)
    path = folder / AGENT_FILE
    if not path.is_file():
        raise AgentRunError(f"{folder}: no {AGENT_FILE} (not a `moelab agent train` output)")
    meta = read_json(path, AgentRunError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AgentRunError(f"{path}: not a {FORMAT} file")
    raw = meta.get("config")
    names = {f.name for f in dataclasses.fields(ComeConfig)}
    if not isinstance(raw, dict) or set(raw) - names:
        raise AgentRunError(f"{path}: config has unknown fields {sorted(set(raw or {}) - names)}")
    try:
        config = ComeConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except InvalidValueError as e:
        raise AgentRunError(f"{path}: {e}") from None
    seed = meta.get("seed")
    if not isinstance(seed, int):
        raise AgentRunError(f"{path}: seed must be an int, got {seed!r}")
    tokenizer = load_tokenizer(folder)
    with warnings.catch_warnings():
        # CoME's normalised top-1 router is trained by its cross-entropy, not the LM loss
        warnings.filterwarnings("ignore", message="top_k=1 with normalised top-k weights")
        model = load_model(folder).eval()
    return AgentRun(model, prepare_data(config, tokenizer=tokenizer), config), seed
