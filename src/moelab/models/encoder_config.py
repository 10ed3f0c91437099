"""Typed config of the BERT text encoder (:class:`moelab.models.encoder.BertEncoder`).

Field names and defaults are those of Hugging Face's ``BertConfig``
(``transformers/models/bert/configuration_bert.py``), so a BERT ``config.json`` maps onto it
field by field; the defaults of the structural fields are MiniLM-L6-H384 (the encoder of
sentence-transformers' all-MiniLM-L6-v2), the others BERT's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.utils.fields import check_fields

REQUIRED_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
"""Fields a ``config.json`` must give (the others default to BERT's values)."""

_UNSUPPORTED_TRUE = ("is_decoder", "add_cross_attention")


@dataclass(frozen=True)
class BertConfig:
    """A post-LayerNorm BERT encoder (Devlin et al. 2019, arXiv 1810.04805).

    Attributes:
        vocab_size: V, WordPiece vocabulary size (>= 1).
        hidden_size: D, residual stream width; a multiple of ``num_attention_heads``.
        num_hidden_layers: L, encoder blocks (>= 1).
        num_attention_heads: H, attention heads (head width ``D / H``).
        intermediate_size: F, feed-forward hidden width (>= 1).
        max_position_embeddings: P, learned absolute positions; sequences hold at most P tokens.
        type_vocab_size: token-type (segment) ids, ``[0, type_vocab_size)`` (>= 1).
        layer_norm_eps: ε of every LayerNorm (> 0; BERT: 1e-12).
        hidden_act: feed-forward activation; only ``"gelu"`` (the exact erf form, which is
            what ``"gelu"`` means in transformers' ``ACT2FN``).
        hidden_dropout_prob: dropout on the embeddings and on each sublayer output before
            its residual add (training mode only), in ``[0, 1)``.
        attention_probs_dropout_prob: dropout on the attention probabilities (training mode
            only), in ``[0, 1)``.
        pad_token_id: the padding token; its embedding row gets no gradient (HF's
            ``padding_idx``). In ``[0, vocab_size)``.
        position_embedding_type: only ``"absolute"``.
    Raises:
        InvalidValueError / InvalidTypeError: a field out of range or of the wrong type, named.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: Literal["gelu"] = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0
    position_embedding_type: Literal["absolute"] = "absolute"

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            if getattr(self, name) < 1:
                raise InvalidValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise InvalidValueError(
                f"hidden_size: {self.hidden_size} is not a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.layer_norm_eps <= 0:
            raise InvalidValueError(f"layer_norm_eps: must be > 0, got {self.layer_norm_eps}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0 <= getattr(self, name) < 1:
                raise InvalidValueError(f"{name}: must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise InvalidValueError(
                f"pad_token_id: must be in [0, {self.vocab_size}), got {self.pad_token_id}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``hidden_size / num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: Any) -> BertConfig:
        """The config of a Hugging Face BERT ``config.json`` (already parsed).

        Fields moelab does not use (``initializer_range``, ``use_cache``, ...) are ignored;
        ones that would change the maths are refused.

        Raises:
            InvalidTypeError: ``hf`` is not a JSON object.
            InvalidValueError: ``model_type`` is not ``"bert"``, a required field is missing,
                a decoder / cross-attention config, or a field out of range (named).
        """
        if not isinstance(hf, dict):
            raise InvalidTypeError(f"config: expected a JSON object, got {type(hf).__name__}")
        if hf.get("model_type", "bert") != "bert":
            raise InvalidValueError(f"model_type: expected 'bert', got {hf['model_type']!r}")
        missing = [f for f in REQUIRED_HF_FIELDS if f not in hf]
        if missing:
            raise InvalidValueError(f"{missing[0]}: required field is missing")
        for name in _UNSUPPORTED_TRUE:
            if hf.get(name):
                raise InvalidValueError(f"{name}: only encoder configs are supported, got true")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in hf.items() if k in names})

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` content (``BertModel``, float32)."""
        return {
            "architectures": ["BertModel"],
            "model_type": "bert",
            "dtype": "float32",
            **dataclasses.asdict(self),
        }
