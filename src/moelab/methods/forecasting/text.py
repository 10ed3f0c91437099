"""The text token: a frozen language model's mean-pooled hidden states, cached per distinct
string and z-scored per dimension on the training texts.

TiMi [S] feeds the exogenous text to a frozen LLM and mean-pools its hidden states into one
text token. Here the LM is SmolLM2-135M (``"smollm2"``: the final, normed hidden states,
576-d) loaded by :func:`moelab.interop.pretrained.load_pretrained`; MiniLM-L6
(``"minilm"``, 384-d, its sentence embedding) is the ablation. The raw pooled vectors of
different notices are nearly parallel (cosine 0.96-1.00 measured on SmolLM2), so each dimension is
z-scored with the mean and std of the training windows' vectors before the router sees it
[I] (``shared/research/wave3-science.md`` §2.3). TiMi's per-sample LLM "inference of future
developments" is not generated: the notices are encoded as they are [I].

An empty text encodes as the zero vector (nothing to pool) [I].
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import Tensor

from moelab.errors import InvalidTypeError, InvalidValueError, UserError
from moelab.models import mean_pool
from moelab.utils.atomic import atomic_write_bytes

TEXT_ENCODERS = ("smollm2", "minilm")
Encode = Callable[[list[str]], Tensor]
"""Non-empty strings → ``[N, D]`` float32 vectors."""


class TextCacheError(UserError, ValueError):
    """A text cache file cannot be read or belongs to another encoder."""


def _smollm2(batch_size: int) -> Encode:
    from moelab.interop.pretrained import load_pretrained

    model, tokenizer = load_pretrained("smollm2", kind="causal_lm")

    def encode(texts: list[str]) -> Tensor:
        out = []
        for i in range(0, len(texts), batch_size):
            ids = [tokenizer.encode(t) for t in texts[i : i + batch_size]]
            S = max(len(t) for t in ids)
            x = torch.zeros(len(ids), S, dtype=torch.long)
            mask = torch.zeros(len(ids), S, dtype=torch.bool)
            for j, t in enumerate(ids):
                x[j, : len(t)] = torch.tensor(t)
                mask[j, : len(t)] = True
            # right padding: a causal model's real positions never see the pads after them
            with torch.no_grad():
                hidden = model(x, mask).hidden_states
            out.append(mean_pool(hidden.float(), mask))
        return torch.cat(out)

    return encode


def _minilm(batch_size: int) -> Encode:
    from moelab.interop.pretrained import load_pretrained

    model, tokenizer = load_pretrained("minilm", kind="encoder")
    return lambda texts: model.encode(texts, tokenizer, batch_size=batch_size)


def load_text_encoder(name: str, batch_size: int = 16) -> Encode:
    """The encoder ``name`` (:data:`TEXT_ENCODERS`) as a function of a list of strings.

    Raises:
        InvalidValueError: unknown name.
        PretrainedNotInstalledError: its package is missing (says how to install it).
    """
    if name == "smollm2":
        return _smollm2(batch_size)
    if name == "minilm":
        return _minilm(batch_size)
    raise InvalidValueError(
        f"text_encoder: must be one of {', '.join(TEXT_ENCODERS)}, got {name!r}"
    )


class TextCache:
    """One vector per distinct string, encoded once (lazily, on first use of ``encode``).

    Args:
        encoder: the encoder's name (recorded in the file; a file of another encoder is
            refused).
        encode: the encoding function (default: :func:`load_text_encoder` of ``encoder``,
            loaded on the first miss).
        path: a ``.safetensors`` file to read at start and rewrite (atomically) after new
            strings are encoded; None = memory only.
    Attributes:
        calls: strings passed to the encoding function so far (a cache hit adds none).
    Raises:
        TextCacheError: ``path`` exists but is not a cache of ``encoder``.
    """

    def __init__(
        self,
        encoder: str = "smollm2",
        encode: Encode | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.encoder = encoder
        self._encode = encode
        self.path = None if path is None else Path(path)
        self._vectors: dict[str, Tensor] = {}
        self.calls = 0
        if self.path is not None and self.path.is_file():
            self._read(self.path)

    def _read(self, path: Path) -> None:
        try:
            data = path.read_bytes()
            vectors = load_safetensors(data).get("vectors")
            meta = _header(data).get("__metadata__", {})  # safetensors keeps strings here
            texts = json.loads(meta.get("texts", "null"))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise TextCacheError(f"{path}: not a text cache ({e})") from None
        if meta.get("encoder") != self.encoder:
            raise TextCacheError(
                f"{path}: a cache of encoder {meta.get('encoder')!r}, not {self.encoder!r}"
            )
        if not isinstance(texts, list) or vectors is None or vectors.shape[0] != len(texts):
            raise TextCacheError(f"{path}: texts and vectors do not match")
        self._vectors = {t: vectors[i] for i, t in enumerate(texts)}

    def _write(self) -> None:
        texts = list(self._vectors)
        data = save_safetensors(
            {"vectors": torch.stack([self._vectors[t] for t in texts]).contiguous()},
            metadata={"encoder": self.encoder, "texts": json.dumps(texts)},
        )
        atomic_write_bytes(self.path, data)

    def __len__(self) -> int:
        """Distinct strings cached."""
        return len(self._vectors)

    def encode(self, texts: Sequence[str]) -> Tensor:
        """``[N, D]`` float32 vectors of ``texts`` (empty strings: zeros).

        Raises:
            InvalidTypeError: ``texts`` is a string or holds a non-string.
            InvalidValueError: ``texts`` is empty, or only empty strings with nothing cached
                (the width is unknown).
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InvalidTypeError("texts: expected a list of strings")
        if not texts:
            raise InvalidValueError("texts: empty list")
        new = [t for t in dict.fromkeys(texts) if t and t not in self._vectors]
        if new:
            if self._encode is None:
                self._encode = load_text_encoder(self.encoder)
            vectors = self._encode(new).float()
            self.calls += len(new)
            self._vectors.update({t: v.clone() for t, v in zip(new, vectors, strict=True)})
            if self.path is not None:
                self._write()
        if not self._vectors:
            raise InvalidValueError("texts: only empty strings; their width is unknown")
        zero = torch.zeros_like(next(iter(self._vectors.values())))
        return torch.stack([self._vectors[t] if t else zero for t in texts])


def _header(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


def zscore_stats(vectors: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Per-dimension ``(mean, std)`` of ``vectors [N, D]`` (population std; a dimension whose
    std is below ``eps`` gets std 1, so it maps to 0 rather than blowing up)."""
    mean = vectors.mean(0)
    std = vectors.std(0, unbiased=False)
    return mean, torch.where(std < eps, torch.ones_like(std), std)
