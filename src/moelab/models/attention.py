"""Causal grouped-query self-attention with rotary embeddings and a KV cache for decoding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.routers.usmoe import PrefixState
from moelab.models.linear import Linear
from moelab.models.norm import RMSNorm
from moelab.models.rope import RotaryEmbedding

QK_NORMS = ("none", "head", "full")


class KVCache:
    """Keys/values of every layer for incremental decoding, grown as positions are written.

    Attributes:
        k, v: per layer ``[B, n_kv_heads, capacity, head_dim]`` (model dtype); ``capacity``
            starts at ``min(max_len, initial_len)`` and doubles (capped at ``max_len``) when a
            write needs more, so a short generation never pays for the full context.
        key_mask: ``[B, capacity]`` bool, True where the cached position is a real token
            (padding given through ``mask`` stays masked out of later attention).
        length: number of positions filled (the next ``start_pos`` of plain decoding).

    Allocate through :meth:`moelab.models.MoETransformer.new_kv_cache`. Use it under
    ``torch.no_grad()`` / ``torch.inference_mode()``: it is written in place. Calling the
    model with ``start_pos < length`` overwrites from ``start_pos`` on (rewind).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        initial_len: int = 64,
    ) -> None:
        for name, v in (
            ("n_layers", n_layers),
            ("batch_size", batch_size),
            ("n_kv_heads", n_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
            ("initial_len", initial_len),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {v!r}")
        self._max_len = max_len
        shape = (batch_size, n_kv_heads, min(max_len, initial_len), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.key_mask = torch.zeros(batch_size, shape[2], dtype=torch.bool, device=device)
        self.length = 0
        # Per MoE layer: router state that later positions need (causal-prefix USMoE).
        self.routing_states: dict[int, PrefixState] = {}

    @property
    def batch_size(self) -> int:
        return self.key_mask.shape[0]

    @property
    def max_len(self) -> int:
        """The most positions the cache may ever hold."""
        return self._max_len

    @property
    def capacity(self) -> int:
        """Positions allocated now (``<= max_len``)."""
        return self.key_mask.shape[1]

    @property
    def n_layers(self) -> int:
        return len(self.k)

    def reserve(self, length: int) -> None:
        """Grow the buffers to hold at least ``length`` positions (doubling, capped at
        ``max_len``); cached contents are kept. Raises ``ValueError`` beyond ``max_len``."""
        if length > self._max_len:
            raise ValueError(
                f"kv_cache: positions up to {length - 1} exceed its max_len={self._max_len}"
            )
        cap = self.capacity
        if length <= cap:
            return
        new_cap = min(self._max_len, max(length, 2 * cap))

        def grown(t: Tensor) -> Tensor:
            out = t.new_zeros((*t.shape[:-2], new_cap, t.shape[-1]))
            out[..., :cap, :] = t
            return out

        self.k = [grown(t) for t in self.k]
        self.v = [grown(t) for t in self.v]
        mask = self.key_mask.new_zeros(self.batch_size, new_cap)
        mask[:, :cap] = self.key_mask
        self.key_mask = mask

    def reset(self) -> None:
        """Forget every cached position (buffers are kept)."""
        self.key_mask.zero_()
        self.length = 0
        self.routing_states.clear()

    def check(self, batch_size: int, start_pos: int, num_new: int) -> None:
        """Raise ``ValueError`` unless ``num_new`` tokens can be written at ``start_pos``."""
        if not isinstance(start_pos, int):
            raise TypeError(
                "start_pos: KVCache holds one position for the whole batch; per-row positions "
                "need a slotted cache (moelab.serve.SlotKVCache)"
            )
        if batch_size != self.batch_size:
            raise ValueError(f"kv_cache: built for batch_size={self.batch_size}, got {batch_size}")
        if start_pos > self.length:
            raise ValueError(
                f"start_pos: {start_pos} leaves a gap; the cache holds {self.length} positions"
            )
        if start_pos + num_new > self.max_len:
            raise ValueError(
                f"kv_cache: positions up to {start_pos + num_new - 1} exceed its "
                f"max_len={self.max_len}"
            )

    def advance(self, start_pos: int, mask: Tensor | None, num_new: int) -> Tensor:
        """Record ``num_new`` new positions from ``start_pos`` (``mask [B, S]`` or None = all
        real) and return the key mask ``[B, start_pos+S]`` of everything attendable."""
        end = start_pos + num_new
        self.reserve(end)
        if mask is None:
            self.key_mask[:, start_pos:end] = True
        else:
            self.key_mask[:, start_pos:end] = mask
        self.key_mask[:, end:] = False
        self.length = end
        return self.key_mask[:, :end]

    def routing_state(self, layer: int, router, start_pos: int) -> PrefixState:
        """Layer ``layer``'s router state holding positions ``0..start_pos−1`` (created
        empty by ``router.new_prefix_state`` on first use; later positions are forgotten
        when the cache is rewound)."""
        state = self.routing_states.get(layer)
        if state is None:
            state = router.new_prefix_state(self.batch_size, self.key_mask.device)
            self.routing_states[layer] = state
        state.truncate(start_pos)
        return state

    def update(self, layer: int, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v [B, Hkv, S, hd]`` at ``start_pos``; return all keys/values so far,
        ``[B, Hkv, start_pos+S, hd]``."""
        end = start_pos + k.shape[2]
        self.reserve(end)
        self.k[layer][:, :, start_pos:end] = k
        self.v[layer][:, :, start_pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped-query heads (GQA) and RoPE.

    ``q = x W_q`` (``H`` heads), ``k, v = x W_k, x W_v`` (``H_kv`` heads, each shared by
    ``H / H_kv`` query heads), RoPE on q and k, ``softmax(q kᵀ / sqrt(hd) + mask) v`` through
    :func:`torch.nn.functional.scaled_dot_product_attention`, then ``W_o``.

    Weights: ``q_proj [H·hd, D]``, ``k_proj``/``v_proj [H_kv·hd, D]``, ``o_proj [D, H·hd]``
    (``nn.Linear`` layout). With ``bias=True`` q/k/v (not o) have biases (Qwen2-MoE's
    ``qkv_bias``). ``qk_norm`` normalises queries and keys with RMSNorm before RoPE:
    ``"head"`` over each head's ``hd`` features, one weight ``[hd]`` shared by the heads
    (Qwen3-MoE ``q_norm``/``k_norm``); ``"full"`` over the whole projection, weights
    ``q_norm [H·hd]`` and ``k_norm [H_kv·hd]`` (OLMoE); ``"none"`` (default) for neither.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RotaryEmbedding,
        layer_idx: int = 0,
        *,
        bias: bool = False,
        qk_norm: str = "none",
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: {n_kv_heads} must divide n_heads={n_heads}")
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm: must be one of {QK_NORMS}, got {qk_norm!r}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.qk_norm = qk_norm
        self.q_proj = Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(n_heads * head_dim, d_model, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, norm_eps)
            self.k_norm = RMSNorm(head_dim, norm_eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(n_heads * head_dim, norm_eps)
            self.k_norm = RMSNorm(n_kv_heads * head_dim, norm_eps)
        self.rope = rope

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        start_pos: int | Tensor = 0,
    ) -> Tensor:
        """``x [B, S, D]`` → ``[B, S, D]``.

        Args:
            attn_mask: bool ``[B or 1, 1, S, start_pos+S]``, True = may attend; must already
                be causal. ``None`` means plain causal attention over ``x`` alone (then
                ``start_pos`` must be 0 or a ``kv_cache`` given with a full-causal view).
            kv_cache: when given, this call's keys/values are written at ``start_pos`` and
                attention runs over cached positions ``0 .. start_pos+S-1``.
            start_pos: absolute position of ``x[:, 0]`` (RoPE offset and cache slot), or an
                int64 ``[B]`` tensor of per-row positions (continuous batching; needs a
                cache that tracks each row, e.g. ``moelab.serve.SlotKVCache``).
        """
        q, k, v = self.project(x)
        q, k = self.rope(q, k, start_pos)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, start_pos, k, v)
        if attn_mask is None and k.shape[2] != x.shape[1]:
            raise ValueError("attn_mask: needed when attending over cached positions")
        return self.attend(q, k, v, attn_mask)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [B, S, D]`` → ``q [B, H, S, hd]``, ``k, v [B, Hkv, S, hd]`` (qk-norm applied,
        RoPE not yet)."""
        B, S, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
        """Attention of ``q [B, H, S, hd]`` over ``k, v [B, Hkv, L, hd]`` (RoPE applied) with
        bool ``attn_mask`` broadcastable to ``[B, H, S, L]`` (True = may attend; None = plain
        causal, needs ``L == S``), then ``W_o`` → ``[B, S, D]``."""
        B, _, S, hd = q.shape
        rep = self.n_heads // self.n_kv_heads
        if rep > 1 and attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] == 1:
            # GQA with a mask shared by the heads: the `rep` query heads of each K/V head
            # become rows of one head ([B, Hkv, rep·S, hd]; row r·S + s is head kv·rep + r,
            # position s) and attend without copying K/V `rep` times (a decode step's cost
            # is reading the cache)
            q = q.reshape(B, self.n_kv_heads, rep * S, hd)
            attn_mask = attn_mask.repeat(1, 1, rep, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            out = out.reshape(B, self.n_heads, S, hd)
        else:
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_heads * hd))


def causal_mask(
    num_new: int, start_pos: int | Tensor, key_mask: Tensor | None, device: torch.device
) -> Tensor | None:
    """Bool attention mask ``[B or 1, 1, S, L]`` (True = may attend), or None when plain
    causal attention over the new tokens suffices (``start_pos == 0``, no padding).

    Query ``i`` of row ``b`` (absolute position ``start_pos+i``, or ``start_pos[b]+i`` when
    ``start_pos`` is an int64 ``[B]`` tensor of per-row positions) sees keys
    ``j <= start_pos+i`` where ``key_mask [B, L]`` is True; ``L = start_pos+S`` for an int,
    ``key_mask.shape[1]`` (required) for per-row positions. Every query always sees itself,
    so a padding query whose visible keys are all padding yields finite (ignored) values
    instead of NaN; real queries are unaffected.
    """
    if isinstance(start_pos, Tensor):
        if key_mask is None:
            raise ValueError("key_mask: needed with per-row start_pos")
        L = key_mask.shape[1]
        q_pos = start_pos[:, None] + torch.arange(num_new, device=device)  # [B, S]
        k_pos = torch.arange(L, device=device)
        allowed = (k_pos <= q_pos[..., None]) & key_mask[:, None, :]  # [B, S, L]
        return (allowed | (k_pos == q_pos[..., None]))[:, None]
    L = start_pos + num_new
    # an all-real key mask allows a cheaper mask; under torch.compile that host read would
    # break the graph, and keeping the key mask gives the same attention
    if key_mask is not None and not torch.compiler.is_compiling() and bool(key_mask[:, :L].all()):
        key_mask = None
    if key_mask is None and start_pos == 0:
        return None
    q_pos = torch.arange(start_pos, L, device=device)
    k_pos = torch.arange(L, device=device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [S, L]
    if key_mask is None:
        return allowed[None, None]
    diag = k_pos[None, :] == q_pos[:, None]
    allowed = (allowed[None] & key_mask[:, None, :L]) | diag[None]  # [B, S, L]
    return allowed[:, None]
