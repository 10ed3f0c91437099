"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv 2104.09864), Llama convention.

Llama / Hugging Face "rotate-half" layout: the head dimension is split into two halves
``[x1, x2]`` and pair ``(x1[i], x2[i])`` is rotated by angle ``pos · θ^(-2i/head_dim)``:

    rope(x, pos) = x · cos + rotate_half(x) · sin,   rotate_half([x1, x2]) = [-x2, x1]

with ``cos``/``sin`` ``[pos, head_dim]`` = the per-pair angles repeated for both halves. Because
each pair is rotated by an angle linear in the position, ``<rope(q, m), rope(k, n)>`` depends on
``m - n`` only (the relative-position property).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] → [-x2, x1]`` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(
    max_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 ``cos, sin`` caches ``[max_len, head_dim]`` (angles computed in fp64 for accuracy)."""
    if head_dim % 2:
        raise ValueError(f"head_dim: must be even, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    t = torch.arange(max_len, dtype=torch.float64)
    ang = torch.outer(t, inv_freq)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().float().to(device), emb.sin().float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, S, hd]`` with ``cos/sin [S, hd]``; computed in fp32, cast back."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys at absolute positions ``start_pos .. start_pos+S-1``.

    The cos/sin caches are fp32 and are *not* buffers: they never enter the state dict and
    a ``model.to(torch.bfloat16)`` cannot round them (they are rebuilt per device on demand).
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim: must be an even int >= 2, got {head_dim}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len: must be >= 1, got {max_seq_len}")
        if theta <= 0:
            raise ValueError(f"theta: must be > 0, got {theta}")
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self._cache: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def cos_sin(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """fp32 ``cos, sin`` ``[max_seq_len, head_dim]`` on ``device``."""
        if device not in self._cache:
            self._cache[device] = rope_cos_sin(self.max_seq_len, self.head_dim, self.theta, device)
        return self._cache[device]

    def forward(self, q: Tensor, k: Tensor, start_pos: int | Tensor = 0) -> tuple[Tensor, Tensor]:
        """``q [B, H, S, hd]``, ``k [B, Hkv, S, hd]`` → rotated (same shapes and dtypes).

        ``start_pos`` is the position of ``q[:, :, 0]``: one int for the batch, or an int64
        ``[B]`` tensor of per-row positions (row ``b`` gets exactly the rotation the int
        ``start_pos[b]`` would give it).

        Raises:
            ValueError: when a position is negative or ``start_pos + S`` exceeds
                ``max_seq_len``.
        """
        S = q.shape[-2]
        if isinstance(start_pos, Tensor):
            lo, hi = (int(v) for v in torch.aminmax(start_pos))
            if lo < 0 or hi + S > self.max_seq_len:
                raise ValueError(
                    f"start_pos: positions {lo}..{hi + S - 1} exceed max_seq_len={self.max_seq_len}"
                )
            cos, sin = self.cos_sin(q.device)
            pos = start_pos[:, None] + torch.arange(S, device=q.device)  # [B, S]
            cos, sin = cos[pos][:, None], sin[pos][:, None]  # [B, 1, S, hd]
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if start_pos < 0 or start_pos + S > self.max_seq_len:
            raise ValueError(
                f"start_pos: positions {start_pos}..{start_pos + S - 1} exceed "
                f"max_seq_len={self.max_seq_len}"
            )
        cos, sin = self.cos_sin(q.device)
        cos, sin = cos[start_pos : start_pos + S], sin[start_pos : start_pos + S]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def at(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE at explicit positions: ``q [B, H, S, hd]``, ``k [B, Hkv, S, hd]``,
        ``positions [S]`` int64 (any order, repeats allowed: block-diffusion branches share
        positions). Raises ValueError for positions outside ``[0, max_seq_len)``."""
        if positions.numel() and (
            int(positions.min()) < 0 or int(positions.max()) >= self.max_seq_len
        ):
            raise ValueError(f"positions: must be in [0, max_seq_len={self.max_seq_len})")
        cos, sin = self.cos_sin(q.device)
        cos, sin = cos[positions], sin[positions]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"
