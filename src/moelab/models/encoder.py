"""A BERT text encoder in plain PyTorch, with a cached-prefix forward and sentence pooling.

The maths is BERT's (Devlin et al. 2019, arXiv 1810.04805) as Hugging Face's ``BertModel``
computes it (``transformers/models/bert/modeling_bert.py``): embeddings
``LayerNorm((word + token_type) + position)``, then L post-LayerNorm blocks

    a = LayerNorm(x + o_proj(MultiHeadAttention(q_proj x, k_proj x, v_proj x)))
    y = LayerNorm(a + down(GELU_erf(up a)))

with padded keys masked by adding ``finfo.min`` to their scores. Dropout (embeddings, attention
probabilities, each sublayer output) acts in training mode only. The pretrained MiniLM-L6
weights of sentence-transformers' all-MiniLM-L6-v2 load through
:func:`moelab.interop.pretrained.load_pretrained` (``"minilm"``); this module reads no files.

Module names (what adapters and hooks target; every projection is an ``nn.Linear``)::

    embeddings.word / .position / .token_type   nn.Embedding   [V|P|types, D]
    embeddings.norm                             nn.LayerNorm
    blocks.{i}                                  BertBlock      (an nn.ModuleList, i = 0..L-1)
    blocks.{i}.attn.q_proj / k_proj / v_proj    nn.Linear D → D (with bias)
    blocks.{i}.attn.o_proj                      nn.Linear D → D (with bias)
    blocks.{i}.attn_norm                        nn.LayerNorm after the attention residual
    blocks.{i}.ffn.up                           nn.Linear D → F
    blocks.{i}.ffn.down                         nn.Linear F → D
    blocks.{i}.ffn_norm                         nn.LayerNorm after the feed-forward residual

Cached prefix: a method that adapts only blocks k..L-1 computes the frozen lower part once
with :meth:`BertEncoder.hidden_at` (``[B, S, D]``, no autograd graph) and then runs
:meth:`BertEncoder.forward_from` per step. ``forward`` is literally ``forward_from(embeddings,
start_block=0)``, so ``forward_from(hidden_at(x, block=k), start_block=k) == forward(x)``
bit for bit (in eval mode; in training mode dropout draws differ).

Pooling follows sentence-transformers (``models/Pooling.py``): mean over the tokens the
attention mask keeps, [CLS] and [SEP] included, the count clamped at 1e-9; all-MiniLM-L6-v2's
``1_Pooling/config.json`` sets ``pooling_mode_mean_tokens`` and its ``modules.json`` ends in
``Normalize``, which :meth:`BertEncoder.encode`'s defaults reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.encoder_config import BertConfig

POOLINGS = ("mean", "cls")

Tokenize = Callable[[Sequence[str]], tuple[Tensor, Tensor]]
"""Texts → ``(input_ids [N, S] int64, attention_mask [N, S] bool)`` padded on the right, e.g.
:class:`moelab.data.encoder_tokenizer.EncoderTokenizer`."""


class BertEmbeddings(nn.Module):
    """``LayerNorm((word[ids] + token_type[types]) + position[0..S-1])``, then dropout."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """``[B, S]`` int64 ids and token types → ``[B, S, D]``."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.word(input_ids) + self.token_type(token_type_ids)
        return self.dropout(self.norm(h + self.position(positions)))


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head attention, ``o_proj(softmax(q kᵀ/√d_head + bias) v)``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """``x [B, S, D]``, additive key bias ``[B, 1, 1, S]`` → ``[B, S, D]``."""
        b, s, _ = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        p = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class BertFFN(nn.Module):
    """``down(GELU_erf(up x))``."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class BertBlock(nn.Module):
    """One post-LayerNorm encoder block (attention, then feed-forward, each residual + norm)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = BertSelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = BertFFN(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """``x [B, S, D]``, additive key bias ``[B, 1, 1, S]`` → ``[B, S, D]``."""
        a = self.attn_norm(x + self.dropout(self.attn(x, bias)))
        return self.ffn_norm(a + self.dropout(self.ffn(a)))


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of ``hidden [B, S, D]`` over the positions ``attention_mask [B, S]`` keeps →
    ``[B, D]`` (sentence-transformers' mean pooling; an all-padding row gives zeros)."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def cls_pool(hidden: Tensor) -> Tensor:
    """The first position's ([CLS]) hidden state: ``[B, S, D]`` → ``[B, D]``."""
    return hidden[:, 0]


def _check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise InvalidValueError(f"pooling: must be one of {', '.join(POOLINGS)}, got {pooling!r}")


def pool(
    hidden: Tensor, attention_mask: Tensor | None, *, pooling: str = "mean", normalize: bool = False
) -> Tensor:
    """Sentence embeddings ``[B, D]`` from hidden states ``[B, S, D]``: :func:`mean_pool`
    (``attention_mask None`` = every position) or :func:`cls_pool`, then L2-normalised when
    ``normalize``. Differentiable.

    Raises:
        InvalidValueError: ``pooling`` is not ``"mean"`` or ``"cls"``.
    """
    _check_pooling(pooling)
    if pooling == "cls":
        out = cls_pool(hidden)
    else:
        mask = hidden.new_ones(hidden.shape[:2]) if attention_mask is None else attention_mask
        out = mean_pool(hidden, mask)
    return F.normalize(out, dim=-1) if normalize else out


class BertEncoder(nn.Module):
    """BERT encoder: token ids → contextual hidden states ``[B, S, D]`` (no pooler, no heads).

    Attributes:
        cfg: the :class:`~moelab.models.encoder_config.BertConfig`.
        embeddings: :class:`BertEmbeddings`.
        blocks: ``nn.ModuleList`` of L :class:`BertBlock` (module names in the module
            docstring).
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        if not isinstance(cfg, BertConfig):
            raise InvalidTypeError(f"cfg: expected a BertConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.blocks = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.num_hidden_layers))

    def _check_ids(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise InvalidValueError("input_ids: expected a [B, S] tensor")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise InvalidTypeError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
        s = input_ids.shape[1]
        if s > self.cfg.max_position_embeddings:
            raise InvalidValueError(
                f"input_ids: {s} tokens exceed max_position_embeddings "
                f"({self.cfg.max_position_embeddings})"
            )
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.cfg.vocab_size):
            raise InvalidValueError(f"input_ids: ids must lie in [0, {self.cfg.vocab_size})")
        if token_type_ids is None:
            return torch.zeros_like(input_ids)
        if token_type_ids.shape != input_ids.shape:
            raise InvalidValueError(
                f"token_type_ids: shape {tuple(token_type_ids.shape)} differs from input_ids "
                f"{tuple(input_ids.shape)}"
            )
        if token_type_ids.numel() and (
            token_type_ids.min() < 0 or token_type_ids.max() >= self.cfg.type_vocab_size
        ):
            raise InvalidValueError(f"token_type_ids: must lie in [0, {self.cfg.type_vocab_size})")
        return token_type_ids

    def _key_bias(self, attention_mask: Tensor | None, b: int, s: int, like: Tensor) -> Tensor:
        """``[B, 1, 1, S]`` additive bias: 0 for kept keys, ``finfo.min`` for padding (HF's
        extended mask; finite, so an all-padding row stays finite)."""
        if attention_mask is None:
            return torch.zeros(b, 1, 1, s, dtype=like.dtype, device=like.device)
        if attention_mask.shape != (b, s):
            raise InvalidValueError(
                f"attention_mask: shape {tuple(attention_mask.shape)}, expected {(b, s)}"
            )
        keep = attention_mask.to(device=like.device, dtype=torch.bool)
        bias = torch.zeros(b, s, dtype=like.dtype, device=like.device)
        bias.masked_fill_(~keep, torch.finfo(like.dtype).min)
        return bias.view(b, 1, 1, s)

    def _run(self, h: Tensor, attention_mask: Tensor | None, start: int, stop: int) -> Tensor:
        bias = self._key_bias(attention_mask, h.shape[0], h.shape[1], h)
        for block in self.blocks[start:stop]:
            h = block(h, bias)
        return h

    def _check_block(self, block: int, name: str) -> None:
        n = self.cfg.num_hidden_layers
        if not isinstance(block, int) or isinstance(block, bool) or not 0 <= block <= n:
            raise InvalidValueError(f"{name}: must be an int in [0, {n}], got {block!r}")

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Last hidden states.

        Args:
            input_ids: ``[B, S]`` int64 token ids in ``[0, vocab_size)``, S <= P.
            attention_mask: ``[B, S]`` bool or 0/1 ints, true at real tokens; ``None`` = all.
            token_type_ids: ``[B, S]`` segment ids; ``None`` = all 0.
        Returns:
            ``[B, S, D]`` in the parameters' dtype (padding positions hold values too; pool
            with the mask).
        Raises:
            InvalidValueError / InvalidTypeError: bad shapes, dtypes or id ranges (named).
        """
        types = self._check_ids(input_ids, token_type_ids)
        return self.forward_from(self.embeddings(input_ids, types), attention_mask, start_block=0)

    def hidden_at(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        block: int,
    ) -> Tensor:
        """Hidden states entering block ``block`` (``block = 0``: the embeddings; ``L``: the
        output), ``[B, S, D]``, computed under ``torch.no_grad`` (a cache for
        :meth:`forward_from`). Arguments as :meth:`forward`. The blocks run in their own
        mode: keep the cached ones in eval mode (no dropout) for a cache that stays valid.

        Raises:
            InvalidValueError: ``block`` outside ``[0, L]``; the checks of :meth:`forward`.
        """
        self._check_block(block, "block")
        types = self._check_ids(input_ids, token_type_ids)
        with torch.no_grad():
            return self._run(self.embeddings(input_ids, types), attention_mask, 0, block)

    def forward_from(
        self, hidden: Tensor, attention_mask: Tensor | None = None, *, start_block: int
    ) -> Tensor:
        """Run blocks ``start_block .. L-1`` on ``hidden [B, S, D]`` (the states entering
        ``start_block``, e.g. from :meth:`hidden_at`) → last hidden states ``[B, S, D]``.

        Raises:
            InvalidValueError: ``start_block`` outside ``[0, L]``, ``hidden`` not ``[B, S, D]``,
                or a mask of another shape.
        """
        self._check_block(start_block, "start_block")
        if not isinstance(hidden, Tensor) or hidden.dim() != 3:
            raise InvalidValueError("hidden: expected a [B, S, D] tensor")
        if hidden.shape[-1] != self.cfg.hidden_size:
            raise InvalidValueError(
                f"hidden: last axis {hidden.shape[-1]}, expected hidden_size {self.cfg.hidden_size}"
            )
        return self._run(hidden, attention_mask, start_block, self.cfg.num_hidden_layers)

    def encode(
        self,
        texts: Sequence[str],
        tokenizer: Tokenize,
        *,
        pooling: str = "mean",
        normalize: bool = True,
        batch_size: int = 32,
    ) -> Tensor:
        """Sentence embeddings of ``texts``, ``[N, D]`` float32 on the CPU, in input order.

        Texts are sorted by length and batched (less padding; the results do not depend on
        the batching beyond float rounding), run in eval mode (the module's mode is restored
        after), pooled, and L2-normalised when ``normalize`` (sentence-transformers'
        all-MiniLM-L6-v2 pipeline: mean pooling, then ``Normalize``).

        Args:
            texts: the sentences (a list, not one string).
            tokenizer: texts → ``(input_ids, attention_mask)``, e.g.
                :class:`~moelab.data.encoder_tokenizer.EncoderTokenizer`.
            pooling: ``"mean"`` (over the attention mask) or ``"cls"``.
            normalize: divide each embedding by its L2 norm.
            batch_size: texts per forward (>= 1).
        Raises:
            InvalidTypeError: ``texts`` is a string or holds a non-string.
            InvalidValueError: unknown ``pooling``, ``batch_size < 1``.
        """
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise InvalidTypeError("texts: expected a list of strings")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidValueError(f"batch_size: must be an int >= 1, got {batch_size!r}")
        _check_pooling(pooling)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        device = next(self.parameters()).device
        out = torch.empty(len(texts), self.cfg.hidden_size, dtype=torch.float32)
        was_training = self.training
        self.eval()
        try:
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                ids, mask = tokenizer([texts[i] for i in idx])
                mask = mask.to(device)
                with torch.inference_mode():
                    h = self(ids.to(device), mask)
                    emb = pool(h, mask, pooling=pooling, normalize=normalize)
                out[idx] = emb.float().cpu()
        finally:
            self.train(was_training)
        return out
