"""RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467), Llama convention."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x², -1) + eps) · weight``.

    The normalisation runs in fp32 whatever the input dtype; the result is cast back to the
    input dtype before the (learned, ones-initialised) ``weight`` ``[D]`` multiplies it, as in
    Llama / Hugging Face ``LlamaRMSNorm``.

    Shapes: ``x [..., D]`` → ``[..., D]`` (dtype of ``x``, promoted with ``weight``'s dtype).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim: must be >= 1, got {dim}")
        if eps <= 0:
            raise ValueError(f"eps: must be > 0, got {eps}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"x: last dim must be {self.weight.shape[0]}, got {tuple(x.shape)}")
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
