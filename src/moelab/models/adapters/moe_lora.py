"""A mixture of LoRA experts on one dense layer, whose experts can grow (old ones frozen).

``y = base(x) + Σ_e g_e(x)·(α/r)·dropout(x)·A_eᵀ·B_eᵀ`` with E experts ``A_e [r, in]``,
``B_e [out, r]`` and a linear router ``ℓ = x·W_rᵀ`` (``W_r [E, in]``, no bias, float32):

- ``top_k=None``: dense weights ``g = softmax(ℓ)`` (MoELoRA; SAME combines with the batch
  mean of these, masked and renormalised, ``wave3-continual.md`` §3.1: a different combine,
  which its recipe builds from :meth:`MoELoRALinear.routing` and :meth:`MoELoRALinear.experts`);
- ``top_k=k``: ``g`` = softmax over the k largest logits, 0 elsewhere (the renormalised top-k
  of Mixtral-style routers).

Every expert is computed on every token (dense; the MoELoRA and SAME baselines' form), so no
dispatch is involved. Init: A as PEFT (Kaiming-uniform, a = √5), B zeros (a fresh layer is a
no-op), router rows as ``nn.Linear``'s default (the same uniform). SAME initialises A with
N(0, 0.01) (``wave3-continual.md`` §3.1): a recipe re-initialises ``lora_A`` for that.

:meth:`MoELoRALinear.grow` adds experts the way MoRAM's ``increment_task`` adds atoms
(``XTAIL/loralib/moram.py``, §2.1): the current experts are copied into the frozen
``old_lora_A``/``old_lora_B`` (separate parameters, ``requires_grad=False``), fresh trainable
``lora_A``/``lora_B`` hold the new ones, and the forward concatenates ``[old; new]``. Old
experts keep their indices; the router grows by one row per new expert and stays trainable.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.models.adapters.lora import check_lora_args, lora_uniform_


class MoELoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus E routed LoRA experts.

    Args:
        base: the layer to adapt; its parameters get ``requires_grad=False``.
        num_experts: E >= 1.
        rank, alpha, dropout: every expert's r, α (scale α/r) and input dropout.
        top_k: None for dense softmax weights, or k in ``[1, E]``.

    Weights:
        lora_A ``[E_new, r, in]``, lora_B ``[E_new, out, r]``: the trainable experts.
        old_lora_A ``[E_old, r, in]``, old_lora_B ``[E_old, out, r]``: frozen experts
            (None before the first :meth:`grow`); they come first in expert order.
        router.weight ``[E, in]``.
    Attributes:
        last_weights: ``[..., E]`` float32 combine weights of the last forward (detached).
        last_record: its :class:`~moelab.core.telemetry.RoutingRecord` (pairs with nonzero
            weight, ``probs = softmax(ℓ)``; every token counted as real).
    Forward:
        x ``[..., in]`` → ``[..., out]`` in x's dtype.
    Raises:
        InvalidTypeError: ``base`` is not an ``nn.Linear``.
        InvalidValueError: E < 1, top_k outside ``[1, E]``, or bad LoRA arguments.
    """

    def __init__(
        self,
        base: nn.Linear,
        num_experts: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        top_k: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise InvalidTypeError(f"base: expected nn.Linear, got {type(base).__name__}")
        check_lora_args(rank, alpha, dropout)
        if not isinstance(num_experts, int) or num_experts < 1:
            raise InvalidValueError(f"num_experts: must be an int >= 1, got {num_experts!r}")
        if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= num_experts):
            raise InvalidValueError(f"top_k: must be None or in [1, {num_experts}], got {top_k!r}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha, self.top_k = rank, float(alpha), top_k
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        w = base.weight
        self.router = nn.Linear(base.in_features, num_experts, bias=False)
        self.router.to(device=w.device, dtype=w.dtype)
        self.register_parameter("old_lora_A", None)
        self.register_parameter("old_lora_B", None)
        self.lora_A, self.lora_B = self._new_experts(num_experts)
        self.last_weights: Tensor | None = None
        self.last_record: RoutingRecord | None = None

    def _new_experts(self, n: int) -> tuple[nn.Parameter, nn.Parameter]:
        w = self.base.weight
        kw = {"dtype": w.dtype, "device": w.device}
        a = lora_uniform_(torch.empty(n, self.rank, self.base.in_features, **kw))
        b = torch.zeros(n, self.base.out_features, self.rank, **kw)
        return nn.Parameter(a), nn.Parameter(b)

    @property
    def scaling(self) -> float:
        """α / r."""
        return self.alpha / self.rank

    @property
    def num_experts(self) -> int:
        """E, old and new experts."""
        return self.router.weight.shape[0]

    @property
    def num_frozen(self) -> int:
        """The old (frozen) experts, indices ``[0, num_frozen)``."""
        return 0 if self.old_lora_A is None else self.old_lora_A.shape[0]

    def experts(self) -> tuple[Tensor, Tensor]:
        """``(A [E, r, in], B [E, out, r])``: old experts then new ones."""
        if self.old_lora_A is None:
            return self.lora_A, self.lora_B
        return torch.cat([self.old_lora_A, self.lora_A]), torch.cat([self.old_lora_B, self.lora_B])

    def frozen_parameters(self) -> Iterator[nn.Parameter]:
        """The old experts (they must keep ``requires_grad=False``)."""
        for p in (self.old_lora_A, self.old_lora_B):
            if p is not None:
                yield p

    def routing(self, x_TI: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(logits [T, E], weights [T, E], selected weights [T, k], selected experts
        [T, k] or None when dense)``, all float32 but the indices."""
        x = x_TI.to(torch.promote_types(x_TI.dtype, torch.float32))
        logits = F.linear(x, self.router.weight.to(x.dtype))
        if self.top_k is None:
            g = torch.softmax(logits, dim=-1)
            return logits, g, g, None
        top, idx = logits.topk(self.top_k, dim=-1)
        sel = torch.softmax(top, dim=-1)
        return logits, torch.zeros_like(logits).scatter(-1, idx, sel), sel, idx

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        x_TI = x.reshape(-1, x.shape[-1])
        logits, g, sel, idx = self.routing(x_TI)
        A, B = self.experts()
        z = torch.einsum("ti,eri->ter", self.dropout(x_TI), A)
        delta = torch.einsum("ter,eor->to", z * g.to(z.dtype).unsqueeze(-1), B)
        self._record(logits, sel, idx, tuple(x.shape[:-1]))
        self.last_weights = g.detach().reshape(*x.shape[:-1], -1)
        return y + self.scaling * delta.reshape(y.shape)

    def _record(self, logits: Tensor, sel: Tensor, idx: Tensor | None, batch_shape) -> None:
        T, E = logits.shape
        k = E if idx is None else idx.shape[1]
        dev = logits.device
        experts = torch.arange(E, device=dev).repeat(T) if idx is None else idx.reshape(-1)
        plan = RoutingPlan(
            token_idx=torch.arange(T, device=dev).repeat_interleave(k),
            expert_idx=experts,
            weight=sel.detach().reshape(-1),
            logits=logits.detach(),
            probs=torch.softmax(logits.detach(), dim=-1),
            num_experts=E,
            top_k=k,
        )
        mask = torch.ones(T, dtype=torch.bool, device=dev)
        self.last_record = RoutingRecord.from_plan(plan, mask, batch_shape, padded=False)

    @torch.no_grad()
    def grow(self, n_new: int) -> None:
        """Freeze the current experts and add ``n_new`` trainable ones (indices
        ``[E, E + n_new)``; A Kaiming-uniform, B zeros, router rows as ``nn.Linear``'s init).
        Replaces ``lora_A``, ``lora_B`` and ``router.weight``: build the optimizer after.

        Raises:
            InvalidValueError: ``n_new`` < 1.
        """
        if not isinstance(n_new, int) or isinstance(n_new, bool) or n_new < 1:
            raise InvalidValueError(f"n_new: must be an int >= 1, got {n_new!r}")
        A, B = self.experts()
        # copies: an optimizer still holding the replaced parameters cannot move them
        self.old_lora_A = nn.Parameter(A.detach().clone(), requires_grad=False)
        self.old_lora_B = nn.Parameter(B.detach().clone(), requires_grad=False)
        self.lora_A, self.lora_B = self._new_experts(n_new)
        w = self.router.weight
        rows = lora_uniform_(torch.empty(n_new, w.shape[1], dtype=w.dtype, device=w.device))
        self.router.weight = nn.Parameter(torch.cat([w.detach(), rows]), w.requires_grad)
        self.router.out_features = self.router.weight.shape[0]

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, frozen={self.num_frozen}, rank={self.rank}, "
            f"alpha={self.alpha}, top_k={self.top_k}"
        )
