"""The bilinear mixture of LoRA experts of MoELoRA and SAME on one dense layer.

``y = W₀x + (α/r)·Σᵢ gᵢ Bᵢ (Σⱼ gⱼ Aⱼ x)`` with E experts ``Aᵢ [r/E, in]``, ``Bᵢ [out, r/E]``
(the total rank r is split evenly, rounded down), as LAMDA-CL/Prism's ``MoELoRALinearA/B`` and
``SAMELinearA/B`` compute it (``PEFT/tuners/custom/moelora.py``, ``same.py``,
``wave3-continual.md`` §3.1): the routing weights scale the A outputs, their sum feeds every B,
and the B outputs are scaled again, so the update is *bilinear* in g (cross terms ``gᵢgⱼBᵢAⱼ``).
:class:`~moelab.models.adapters.moe_lora.MoELoRALinear`'s ``Σ gₑ BₑAₑ x`` is the diagonal of it.

:class:`BilinearMoELoRALinear` routes every token with its own ``g = softmax(x W_Gᵀ)`` (MoELoRA,
``moelora.py::forward``: dropout on x feeds the router and the A experts). SAME keeps the
layer and replaces the routing (:class:`moelab.methods.continual.same_layer.SAMELinear`).

Init as Prism's ``reset_lora_parameters``: A ~ N(0, 0.01²), B = 0 (a fresh layer is a no-op);
the router is an ``nn.Linear(in, E, bias=False)`` with torch's default init.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.adapters.lora import check_lora_args


class BilinearMoELoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus E bilinearly combined LoRA experts, routed per token.

    Args:
        base: the layer to adapt; its parameters get ``requires_grad=False``.
        num_experts: E >= 1.
        rank: the total rank r >= E; each expert has rank ⌊r/E⌋ (``out_features //
            expert_num`` [C]), the scale stays α/r.
        alpha: α > 0; the update is scaled by α/r.
        dropout: dropout on the input of the router and the A experts (MoELoRA's
            ``lora_dropout``).
        init_std: the standard deviation of A's normal init (0.01 [C]).

    Weights:
        lora_A ``[E, ⌊r/E⌋, in]``, lora_B ``[E, out, ⌊r/E⌋]``, router.weight ``[E, in]``.
    Attributes:
        last_weights: ``[..., E]`` float32 combine weights of the last forward (detached).
        last_record: its :class:`~moelab.core.telemetry.RoutingRecord` (every expert a pair,
            weight g; ``probs = g``).
    Forward:
        x ``[..., in]`` → ``[..., out]`` in x's dtype.
    Raises:
        InvalidTypeError: ``base`` is not an ``nn.Linear``.
        InvalidValueError: E < 1, r < E, bad LoRA arguments.
    """

    def __init__(
        self,
        base: nn.Linear,
        num_experts: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        init_std: float = 0.01,
    ) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise InvalidTypeError(f"base: expected nn.Linear, got {type(base).__name__}")
        check_lora_args(rank, alpha, dropout)
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise InvalidValueError(f"num_experts: must be an int >= 1, got {num_experts!r}")
        if rank < num_experts:
            raise InvalidValueError(f"rank: must be >= num_experts={num_experts}, got {rank}")
        if not init_std > 0:
            raise InvalidValueError(f"init_std: must be > 0, got {init_std!r}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = rank, float(alpha)
        E, re = num_experts, rank // num_experts
        w = base.weight
        kw = {"dtype": w.dtype, "device": w.device}
        self.lora_A = nn.Parameter(torch.randn(E, re, base.in_features, **kw) * init_std)
        self.lora_B = nn.Parameter(torch.zeros(E, base.out_features, re, **kw))
        self.router = nn.Linear(base.in_features, E, bias=False, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.last_weights: Tensor | None = None
        self.last_record: RoutingRecord | None = None

    @property
    def scaling(self) -> float:
        """α / r."""
        return self.alpha / self.rank

    @property
    def num_experts(self) -> int:
        return self.lora_A.shape[0]

    def combine(self, x: Tensor, g: Tensor) -> Tensor:
        """``(α/r)·Σᵢ gᵢ Bᵢ (Σⱼ gⱼ Aⱼ x)`` ``[..., out]`` for ``x [..., in]`` and weights ``g``
        broadcastable to ``[..., E]`` (per token, per row or one ``[E]`` for all)."""
        E, re, d_in = self.lora_A.shape
        g = g.to(x.dtype)
        z = (x @ self.lora_A.reshape(E * re, d_in).T).unflatten(-1, (E, re))
        z = (z * g.unsqueeze(-1)).sum(-2)  # Σⱼ gⱼ Aⱼ x  [..., r/E]
        u = (g.unsqueeze(-1) * z.unsqueeze(-2)).flatten(-2)  # gᵢ ⊗ z  [..., E·r/E]
        b = self.lora_B.permute(1, 0, 2).reshape(self.lora_B.shape[1], E * re)
        return self.scaling * (u @ b.T)

    def forward(self, x: Tensor) -> Tensor:
        xd = self.dropout(x)
        logits = self.router(xd.to(self.router.weight.dtype))
        g = torch.softmax(logits.float(), dim=-1)
        self.record(g)
        return self.base(x) + self.combine(xd, g).to(x.dtype)

    def record(self, g: Tensor, token_mask: Tensor | None = None) -> None:
        """Keep ``g [..., E]`` (detached) as :attr:`last_weights` and :attr:`last_record`
        (``token_mask [...]`` bool marks the real rows; all by default)."""
        g = g.detach().float()
        self.last_weights = g
        self.last_record = weights_record(g, token_mask)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, rank={self.rank}, alpha={self.alpha}"


def weights_record(g: Tensor, token_mask: Tensor | None = None) -> RoutingRecord:
    """A :class:`~moelab.core.telemetry.RoutingRecord` of dense combine weights ``g [..., E]``:
    every (row, expert) pair with weight g, ``probs = g`` (so ``top1`` is the heaviest
    expert); ``token_mask [...]`` bool marks real rows (all by default)."""
    flat = g.detach().float().reshape(-1, g.shape[-1])
    T, E = flat.shape
    plan = RoutingPlan(
        token_idx=torch.arange(T).repeat_interleave(E),
        expert_idx=torch.arange(E).repeat(T),
        weight=flat.reshape(-1),
        logits=flat.clamp_min(1e-12).log(),
        probs=flat,
        num_experts=E,
        top_k=E,
    )
    mask = torch.ones(T, dtype=torch.bool) if token_mask is None else token_mask.reshape(-1)
    return RoutingRecord.from_plan(plan, mask, tuple(g.shape[:-1]), padded=token_mask is not None)


__all__ = ["BilinearMoELoRALinear", "weights_record"]
