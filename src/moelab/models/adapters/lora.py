"""LoRA on one dense layer: a frozen ``nn.Linear`` plus a trainable low-rank update.

``y = base(x) + (α/r)·dropout(x)·Aᵀ·Bᵀ`` with ``A [r, in]`` and ``B [out, r]`` (Hu et al.,
"LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv 2106.09685, Eq. 3).
PEFT's init (``peft.tuners.lora.LoraLayer.reset_lora_parameters``, ``init_lora_weights=True``):
A Kaiming-uniform with a = √5 (bound ``1/√in``), B zeros, so a fresh adapter adds exact zeros
and the outputs are bit-identical to the base layer's. PEFT's names and layouts; the
parameters are plain tensors here (``lora_A``, ``lora_B``) rather than ``nn.Linear``s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.linear import Linear


def check_lora_args(rank: int, alpha: float, dropout: float) -> None:
    """Raises InvalidValueError for rank < 1, alpha <= 0 or dropout outside [0, 1)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidValueError(f"rank: must be an int >= 1, got {rank!r}")
    if not alpha > 0:
        raise InvalidValueError(f"alpha: must be > 0, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise InvalidValueError(f"dropout: must be in [0, 1), got {dropout!r}")


def lora_uniform_(t: Tensor) -> Tensor:
    """In place U(−1/√fan_in, 1/√fan_in) with fan_in = ``t.shape[-1]``: ``kaiming_uniform_``
    with a = √5 (PEFT's A init), also for stacked ``[..., r, in]`` tensors."""
    bound = 1.0 / math.sqrt(t.shape[-1])
    with torch.no_grad():
        return t.uniform_(-bound, bound)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` with a LoRA adapter.

    Args:
        base: the layer to adapt; its parameters get ``requires_grad=False``.
        rank: r >= 1.
        alpha: α > 0; the update is scaled by α/r.
        dropout: dropout probability on the adapter's input (PEFT ``lora_dropout``).

    Weights:
        lora_A: ``[r, in]``, lora_B: ``[out, r]``, in the base weight's dtype and device.
    Forward:
        x ``[..., in]`` → ``[..., out]``.
    Raises:
        InvalidTypeError: ``base`` is not an ``nn.Linear``.
        InvalidValueError: see :func:`check_lora_args`.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise InvalidTypeError(f"base: expected nn.Linear, got {type(base).__name__}")
        check_lora_args(rank, alpha, dropout)
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = rank, float(alpha)
        w = base.weight
        kw = {"dtype": w.dtype, "device": w.device}
        self.lora_A = nn.Parameter(lora_uniform_(torch.empty(rank, base.in_features, **kw)))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **kw))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def scaling(self) -> float:
        """α / r."""
        return self.alpha / self.rank

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        return y + self.scaling * ((self.dropout(x) @ self.lora_A.T) @ self.lora_B.T)

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """A linear layer of the base's class (``nn.Linear``, or the LM's
        :class:`~moelab.models.linear.Linear`) with ``W + (α/r)·B·A`` (and the base bias);
        trainable, new tensors (a base weight tied to another module is not tied to it any
        more)."""
        b = self.base
        cls = Linear if isinstance(b, Linear) else nn.Linear
        out = cls(b.in_features, b.out_features, bias=b.bias is not None)
        out = out.to(device=b.weight.device, dtype=b.weight.dtype)
        out.weight.copy_(b.weight + self.scaling * (self.lora_B @ self.lora_A))
        if b.bias is not None:
            out.bias.copy_(b.bias)
        return out.train(self.training)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"
