"""CaRE's Bi-Level Routing MoE adapter (BR-MoE), as ``backbone/vit_brmoe.py::MoEAdapter`` of
LMMMEng/CaRE @ d90800a0 runs it [C] (``wave3-continual.md`` §1.1).

One BR-MoE sits beside the FFN of an adapted block. Task ``t`` adds expert ``t`` (a
bottleneck adapter ``σ ⊙ up(dropout(relu(down(LN(a)))))``), router ``t`` (``Linear(D → t+1)``,
trunc-normal(0.02), zero bias) and latent head ``t`` (``LayerNorm → Linear(D → classes of
task t)``); everything older is frozen (separate parameters, so old experts stay bit for bit).
A shared adapter (bottleneck ``shared_dim``) is added to every output.

Per input, each expert's output is pooled to a routing token ``u_e`` (mean over the mask [I],
or the first token [C]); latent head ``e`` gives logits ``ℓ_e(u_e)`` and router ``e`` scores
``r_e(u_e)`` (padded with ``-inf`` to the experts in use).

* **Router selection** (first level): the routers whose latent heads have the lowest entropy
  ``H(softmax ℓ_e)`` are selected: ``topk_routers`` of them at test (``full_dynamic_forward``),
  and while training task ``t`` the ``topk_routers - 1`` lowest among the old ones plus the
  current router (``semi_dynamic_forward``).
* **Expert routing** (second level): each selected router keeps its ``topk_experts`` largest
  scores (the rest set to ``-100``, not ``-inf`` [C]), softmax; the output is the **sum** over
  the selected routers of the weighted expert outputs (einsum ``'r b e, b r e n c -> b n c'``).
* With one expert in use (task 0) the output is expert 0's.

Init [C]: both projections of every adapter Kaiming-uniform (a = √5), biases zero, the
per-channel scale σ zero (so a fresh BR-MoE adds zeros); a new expert (from the third on) is
the mean of all experts but the newest; the latent head's trunc-normal(0.02) init hits its
LayerNorm weight (as released), its Linear keeps PyTorch's default.

Shared adapter [C]: free on task 0; on later tasks pinned on every training step,
``θ ← decay·θ₀ + (1 - decay)·θ`` with ``θ₀`` its value when the half-schedule began
(:meth:`BRMoE.set_anchor`, :meth:`BRMoE.pin_shared`).

The experts are computed together: with ``x̂`` the normalised input, expert ``e`` is
``σ_e ⊙ (U_e relu(W_e (x̂ γ_e + β_e) + b_e) + c_e)``, so ``W_e diag(γ_e)`` and ``diag(σ_e) U_e``
are folded, and pooling (linear) is applied before the up-projection; the ``[B, S, E, D]``
tensor of every expert's output is never formed. Same maths as the per-expert loop up to
float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError
from moelab.models.adapters.lora import lora_uniform_
from moelab.models.adapters.parallel import ParallelAdapter


def care_adapter(dim: int, bottleneck: int, dropout: float) -> ParallelAdapter:
    """CaRE's ``Adapter`` (LayerNorm in, ReLU, per-channel scale 0, both projections
    Kaiming-uniform a = √5 [C])."""
    a = ParallelAdapter(
        dim, bottleneck, scale=0.0, learnable_scale="channel", layer_norm=True, dropout=dropout
    )
    lora_uniform_(a.up.weight)
    return a


def entropy(logits: Tensor) -> Tensor:
    """``-Σ p log(p + 1e-10)`` over the last axis, ``p = softmax(logits)`` [C]."""
    p = torch.softmax(logits, dim=-1)
    return -(p * torch.log(p + 1e-10)).sum(-1)


def topk_mask(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest entries of the last axis, set the others to -100 [C]
    (no-op when ``k`` covers the axis)."""
    if k >= logits.shape[-1]:
        return logits
    idx = logits.topk(k, dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
    return logits.masked_fill(~keep, -100.0)


@dataclass
class BRMoESide:
    """What a BR-MoE returns beside its output.

    Attributes:
        latent: ``[B, C_t]`` logits of the current task's latent head (training forward with
            a task id), else None.
        routers: ``[R, B]`` the routers used per sample (None with one expert).
        entropies: ``[E, B]`` latent-head entropies the selection saw (None with one expert).
    """

    latent: Tensor | None
    routers: Tensor | None
    entropies: Tensor | None


class BRMoE(nn.Module):
    """A growing BR-MoE on ``[B, S, D]`` (module docstring).

    Args:
        dim: D.
        expert_dim, shared_dim: bottlenecks of the experts and of the shared adapter.
        topk_experts, topk_routers: see the module docstring.
        dropout: after each adapter's ReLU.
        routing_token: ``"mean"`` or ``"cls"``.
    """

    def __init__(
        self,
        dim: int,
        expert_dim: int,
        shared_dim: int,
        topk_experts: int = 3,
        topk_routers: int = 2,
        dropout: float = 0.1,
        routing_token: str = "mean",
    ) -> None:
        super().__init__()
        if routing_token not in ("mean", "cls"):
            raise InvalidValueError(
                f"routing_token: must be 'mean' or 'cls', got {routing_token!r}"
            )
        self.dim, self.expert_dim, self.dropout = dim, expert_dim, dropout
        self.topk_experts, self.topk_routers = topk_experts, topk_routers
        self.routing_token = routing_token
        self.experts = nn.ModuleList()
        self.routers = nn.ModuleList()
        self.latent_heads = nn.ModuleList()
        self.shared = care_adapter(dim, shared_dim, dropout)
        self._anchor: list[Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def grow(self, num_classes: int) -> None:
        """Add expert, router and latent head for a task of ``num_classes`` classes; freeze
        every older one (``_update_adapters`` [C])."""
        new = care_adapter(self.dim, self.expert_dim, self.dropout)
        n = self.num_experts
        if n > 1:  # the mean of all experts but the newest [C]
            with torch.no_grad():
                for name, p in new.named_parameters():
                    old = [self.experts[i].get_parameter(name) for i in range(n - 1)]
                    p.copy_(torch.stack(old).mean(0))
        self.requires_grad_(False)
        self.experts.append(new)
        router = nn.Linear(self.dim, n + 1)
        nn.init.trunc_normal_(router.weight, std=0.02)
        nn.init.zeros_(router.bias)
        self.routers.append(router)
        head = nn.Sequential(nn.LayerNorm(self.dim), nn.Linear(self.dim, num_classes))
        nn.init.trunc_normal_(head[0].weight, std=0.02)  # the LayerNorm, as released [C]
        nn.init.zeros_(head[0].bias)
        self.latent_heads.append(head)
        for m in (self.shared, new, router, head):
            m.requires_grad_(True)

    def set_anchor(self) -> None:
        """Pin the shared adapter to its current value (``_load_shared_adapter`` [C])."""
        self._anchor = [p.detach().clone() for p in self.shared.parameters()]

    def clear_anchor(self) -> None:
        self._anchor = None

    def pin_shared(self, decay: float) -> None:
        """``θ ← decay·θ₀ + (1 - decay)·θ`` on the shared adapter (no-op without an anchor)."""
        if self._anchor is None:
            return
        with torch.no_grad():
            for p, a in zip(self.shared.parameters(), self._anchor, strict=True):
                p.copy_(decay * a + (1 - decay) * p)

    def _pool(self, z: Tensor, mask: Tensor) -> Tensor:
        if self.routing_token == "cls":
            return z[:, 0]
        m = mask.to(z.dtype)[:, :, None, None]
        return (z * m).sum(1) / m.sum(1).clamp(min=1e-9)

    def forward(self, a: Tensor, mask: Tensor, task: int | None = None) -> tuple[Tensor, BRMoESide]:
        """``a [B, S, D]`` (the post-attention stream), ``mask [B, S]`` bool → the delta
        ``[B, S, D]`` to add beside the FFN, and a :class:`BRMoESide`.

        Args:
            task: the current task id while training (experts ``0..task``, semi-dynamic
                routing); None at test (every expert, full-dynamic routing).
        Raises:
            InvalidValueError: no experts yet, or ``task`` beyond them.
        """
        E = self.num_experts if task is None else task + 1
        if self.num_experts == 0 or not 1 <= E <= self.num_experts:
            raise InvalidValueError(f"task: {task} with {self.num_experts} experts")
        experts = list(self.experts)[:E]
        gamma = torch.stack([e.norm.weight for e in experts])  # [E, D]
        beta = torch.stack([e.norm.bias for e in experts])
        W = torch.stack([e.down.weight for e in experts])  # [E, d, D]
        b = torch.stack([e.down.bias for e in experts])  # [E, d]
        U = torch.stack([e.up.weight for e in experts])  # [E, D, d]
        c = torch.stack([e.up.bias for e in experts])  # [E, D]
        sigma = torch.stack([e.scale for e in experts])  # [E, D]
        eps = experts[0].norm.eps
        xhat = F.layer_norm(a, (a.shape[-1],), eps=eps)
        Wf = W * gamma[:, None, :]
        bf = torch.einsum("edD,eD->ed", W, beta) + b
        z = torch.relu(torch.einsum("bsD,edD->bsed", xhat, Wf) + bf)
        z = F.dropout(z, self.dropout, self.training)
        Uf = U * sigma[:, :, None]
        cf = c * sigma
        tokens = torch.einsum("bed,eDd->beD", self._pool(z, mask), Uf) + cf  # [B, E, D]
        latents = [self.latent_heads[e](tokens[:, e]) for e in range(E)]
        shared = self.shared(a)
        if E == 1:
            w = a.new_ones(a.shape[0], 1)
            side = BRMoESide(latents[0] if task is not None else None, None, None)
        else:
            scores = []
            for e in range(E):
                s = self.routers[e](tokens[:, e])
                pad = s.new_full((s.shape[0], E - s.shape[1]), float("-inf"))
                scores.append(torch.cat([s, pad], -1))
            scores = torch.stack(scores)  # [E routers, B, E experts]
            if task is None:
                H = torch.stack([entropy(x) for x in latents])  # [E, B]
                k = min(self.topk_routers, E)
                chosen = H.topk(k, dim=0, largest=False).indices  # [k, B]
            else:
                H = torch.stack([entropy(x) for x in latents[:task]])  # [t, B] old tasks
                k = min(self.topk_routers - 1, task)
                old = H.topk(k, dim=0, largest=False).indices
                cur = torch.full((1, a.shape[0]), task, dtype=torch.long)
                chosen = torch.cat([old, cur])
            batch = torch.arange(a.shape[0])
            logits = scores[chosen, batch[None, :]]  # [R, B, E]
            probs = torch.softmax(topk_mask(logits, self.topk_experts), dim=-1)
            w = probs.sum(0)  # the sum over the selected routers [C]
            side = BRMoESide(latents[task] if task is not None else None, chosen, H)
        delta = torch.einsum("bsed,be,eDd->bsD", z, w, Uf) + (w @ cf)[:, None, :]
        return delta + shared, side
