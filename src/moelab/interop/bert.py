"""Hugging Face BERT checkpoint folders ↔ :class:`moelab.models.encoder.BertEncoder`.

A folder holds ``config.json`` (a ``BertConfig``) and ``model.safetensors`` (or a sharded
index, see :mod:`moelab.interop.files`), optionally ``tokenizer.json`` and
sentence-transformers' ``sentence_bert_config.json``. Tensor names are transformers'
``BertModel`` ones, with or without the ``bert.`` prefix that task models (``BertFor...``) add:

    embeddings.word_embeddings.weight             → embeddings.word.weight
    embeddings.position_embeddings.weight         → embeddings.position.weight
    embeddings.token_type_embeddings.weight       → embeddings.token_type.weight
    embeddings.LayerNorm.{weight,bias}            → embeddings.norm.*
    encoder.layer.{i}.attention.self.query.*      → blocks.{i}.attn.q_proj.*   (key → k_proj,
                                                    value → v_proj)
    encoder.layer.{i}.attention.output.dense.*    → blocks.{i}.attn.o_proj.*
    encoder.layer.{i}.attention.output.LayerNorm.* → blocks.{i}.attn_norm.*
    encoder.layer.{i}.intermediate.dense.*        → blocks.{i}.ffn.up.*
    encoder.layer.{i}.output.dense.*              → blocks.{i}.ffn.down.*
    encoder.layer.{i}.output.LayerNorm.*          → blocks.{i}.ffn_norm.*

Both sides use ``nn.Linear`` layout, so every tensor is copied unchanged. Dropped on purpose:
the ``embeddings.position_ids`` / ``embeddings.token_type_ids`` buffers (positions are
``0..S-1`` and types default to 0 here) and the NSP ``pooler.dense.*`` (sentence embeddings
pool the hidden states instead; sentence-transformers ignores it too). Any other tensor, a
task head included, is refused by name rather than dropped silently.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from moelab.data.encoder_tokenizer import EncoderTokenizer
from moelab.errors import InvalidValueError, UserError
from moelab.interop.errors import (
    InteropError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
)
from moelab.interop.files import SAFETENSORS, read_json, read_tensors
from moelab.models.encoder import BertEncoder
from moelab.models.encoder_config import BertConfig
from moelab.utils.atomic import atomic_write_json, write_folder_atomically

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SENTENCE_CONFIG = "sentence_bert_config.json"
"""sentence-transformers' file holding ``max_seq_length`` (256 for all-MiniLM-L6-v2)."""
PREFIX = "bert."
DROPPED = frozenset(
    {
        "embeddings.position_ids",
        "embeddings.token_type_ids",
        "pooler.dense.weight",
        "pooler.dense.bias",
    }
)
"""HF tensors read and ignored (see the module docstring)."""

_EMBEDDINGS = {
    "word_embeddings": "word",
    "position_embeddings": "position",
    "token_type_embeddings": "token_type",
    "LayerNorm": "norm",
}
_BLOCK = {
    "attention.self.query": "attn.q_proj",
    "attention.self.key": "attn.k_proj",
    "attention.self.value": "attn.v_proj",
    "attention.output.dense": "attn.o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn.up",
    "output.dense": "ffn.down",
    "output.LayerNorm": "ffn_norm",
}


def hf_to_moelab_names(cfg: BertConfig) -> dict[str, str]:
    """``{HF BertModel tensor name: BertEncoder state-dict name}`` for ``cfg`` (no prefix)."""
    names = {}
    for hf, ours in _EMBEDDINGS.items():
        params = ("weight", "bias") if hf == "LayerNorm" else ("weight",)
        for p in params:
            names[f"embeddings.{hf}.{p}"] = f"embeddings.{ours}.{p}"
    for i in range(cfg.num_hidden_layers):
        for hf, ours in _BLOCK.items():
            for p in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{p}"] = f"blocks.{i}.{ours}.{p}"
    return names


def read_bert_config(folder: str | os.PathLike[str]) -> BertConfig:
    """The :class:`BertConfig` of ``folder/config.json``.

    Raises:
        InteropError: the file is missing or not valid JSON, or a field is missing, of the
            wrong type or unsupported; the message names the file and the field.
    """
    path = Path(folder) / CONFIG
    hf = read_json(path)
    try:
        return BertConfig.from_hf(hf)
    except UserError as e:
        raise InteropError(f"{path}: {e}") from e


def _renamed(tensors: dict[str, Tensor], cfg: BertConfig, where: Path) -> dict[str, Tensor]:
    names = hf_to_moelab_names(cfg)
    state: dict[str, Tensor] = {}
    unexpected = []
    for name, t in tensors.items():
        bare = name.removeprefix(PREFIX)
        if bare in DROPPED:
            continue
        if bare not in names:
            unexpected.append(name)
        elif names[bare] in state:
            raise InteropError(f"{where}: tensor {bare!r} is stored with and without {PREFIX!r}")
        else:
            state[names[bare]] = t
    if unexpected:
        raise UnexpectedTensorError(
            f"{where}: {len(unexpected)} tensor(s) a BertModel has no place for: "
            f"{sorted(unexpected)[:8]}"
        )
    missing = sorted(hf for hf, ours in names.items() if ours not in state)
    if missing:
        raise MissingTensorError(
            f"{where}: {len(missing)} tensor(s) missing for {CONFIG}: {missing[:8]}"
        )
    return state


def load_bert(folder: str | os.PathLike[str]) -> BertEncoder:
    """The float32 :class:`BertEncoder` of a Hugging Face BERT folder, in eval mode.

    Raises:
        InteropError: ``config.json`` or the safetensors file is missing, corrupt or
            truncated (named); ``MissingTensorError`` / ``UnexpectedTensorError`` /
            ``TensorShapeError`` naming the tensors.
    """
    folder = Path(folder)
    cfg = read_bert_config(folder)
    tensors = read_tensors(folder)
    where = folder / SAFETENSORS if (folder / SAFETENSORS).is_file() else folder
    state = _renamed(tensors, cfg, where)
    with torch.device("meta"):
        model = BertEncoder(cfg)
    for name, ref in model.state_dict().items():
        t = state[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise TensorShapeError(
                f"{where}: {name} has shape {tuple(t.shape)}, {CONFIG} implies {tuple(ref.shape)}"
            )
        if not t.is_floating_point():
            raise InteropError(f"{where}: {name} has dtype {t.dtype}, expected a float tensor")
        state[name] = t.float()
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def save_bert(
    model: BertEncoder, out_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Write ``model`` as a Hugging Face ``BertModel`` folder (``config.json`` +
    ``model.safetensors``, unprefixed names, no pooler: transformers initialises one and
    warns). The folder appears complete or not at all.

    Raises:
        OutputFolderError: see :func:`moelab.utils.atomic.write_folder_atomically`.
    """
    ours_to_hf = {ours: hf for hf, ours in hf_to_moelab_names(model.cfg).items()}
    tensors = {ours_to_hf[k]: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}

    def fill(tmp: Path) -> None:
        atomic_write_json(tmp / CONFIG, model.cfg.to_hf(), sort_keys=True)
        save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})

    out = Path(out_dir)
    write_folder_atomically(out, fill, overwrite)
    return out


def bert_max_length(folder: str | os.PathLike[str], cfg: BertConfig) -> int:
    """Default tokens per text for ``folder``: sentence-transformers' ``max_seq_length``
    when ``sentence_bert_config.json`` exists, else ``max_position_embeddings``.

    Raises:
        InteropError: that file is unreadable, or its value is not an int in ``[2, P]``.
    """
    path = Path(folder) / SENTENCE_CONFIG
    if not path.is_file():
        return cfg.max_position_embeddings
    st = read_json(path)
    n = st.get("max_seq_length") if isinstance(st, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= cfg.max_position_embeddings:
        raise InteropError(
            f"{path}: max_seq_length must be an int in [2, {cfg.max_position_embeddings}], "
            f"got {n!r}"
        )
    return n


def load_bert_tokenizer(
    folder: str | os.PathLike[str], cfg: BertConfig, *, max_length: int | None = None
) -> EncoderTokenizer:
    """The :class:`EncoderTokenizer` of ``folder/tokenizer.json``.

    Args:
        max_length: tokens per text; ``None`` = :func:`bert_max_length`. At most
            ``cfg.max_position_embeddings``.
    Raises:
        InvalidValueError: ``max_length`` outside ``[2, P]``. TokenizerError: the file is
            missing or corrupt (named). InteropError: see :func:`bert_max_length`.
    """
    if max_length is None:
        max_length = bert_max_length(folder, cfg)
    elif isinstance(max_length, int) and max_length > cfg.max_position_embeddings:
        raise InvalidValueError(
            f"max_length: {max_length} exceeds max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    return EncoderTokenizer.from_file(Path(folder) / TOKENIZER, max_length=max_length)
