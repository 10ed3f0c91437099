"""The MoE step of one TEAM forward: decoded-delayed caching (DCD) and limited activation (LAC).

TEAM (Wei, Luo, Tang, Li; ICML 2026; arXiv 2602.08404), as the authors' code
(``SDARMoeSparseMoeBlock.forward`` of PKU-SEC-Lab/TEAM-MoE-dLLM) does it:

- **DCD**: rows flagged ``reuse`` skip the router and the experts; their MoE output is copied
  from the previous forward's stored outputs (attention is still computed by the caller).
- **LAC**: over the computed rows, ``E_A`` = the union of the top-k experts of the rows that
  are not ``cold``; the routing probabilities of experts outside ``E_A`` are zeroed for every
  computed row, top-k is re-taken and the weights renormalised (``norm_topk_prob``). Non-cold
  rows are unchanged by construction (their top-k is inside ``E_A``), so only the cold rows
  are recomputed. Our choice: with no non-cold row there is no restriction.

LAC needs the softmax-before-top-k token-choice routing of SDAR/Qwen3-MoE (no bias, groups or
capacity); other routers are refused with ``ValueError``. Without ``reuse`` and ``cold`` the
step is exactly the layer's own routing (dropless token choice).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moelab.core.plan import RoutingPlan
from moelab.core.routers.scores import router_scores, topk_weights
from moelab.errors import InvalidValueError
from moelab.models.block import DecoderBlock


def check_team_router(block: DecoderBlock) -> None:
    """Raise ``ValueError`` unless the MoE layer routes with dropless token choice."""
    cfg = block.ffn.config.router
    if cfg.kind != "token_choice" or cfg.capacity_factor is not None:
        raise InvalidValueError(
            f"router: TEAM decoding needs dropless token-choice routing, layer "
            f"{block.layer_idx} has kind={cfg.kind!r} capacity_factor={cfg.capacity_factor}"
        )


def limited_topk(
    scores: Tensor, active: Tensor, top_k: int, normalise: bool
) -> tuple[Tensor, Tensor]:
    """Top-k of ``scores [T, E]`` (float32 probabilities) with experts outside ``active [E]``
    (bool) zeroed; weights ``/ sum`` when ``normalise``. Returns ``(weights [T, k], idx [T, k])``."""
    s = scores.masked_fill(~active, 0.0)
    w, idx = s.topk(top_k, dim=-1)
    if normalise:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return w, idx


class TeamMoEStep:
    """A :data:`moelab.models.block_diffusion.MoEHook` for one forward over ``T`` rows, on
    blocks whose routers passed :func:`check_team_router`.

    Args:
        reuse: ``[T]`` bool, rows whose MoE output is copied from ``stored`` (DCD), or None.
        stored: per layer index ``[T, D]`` outputs to copy (needed with ``reuse``).
        cold: ``[T]`` bool, rows restricted to the experts of the non-cold rows (LAC), or None.

    After the forward, ``outputs[layer]`` holds every row's MoE output ``[T, D]`` (computed or
    copied), ``experts[layer]`` the ``[E]`` bool set of experts that computed anything and
    ``choice[layer]`` the ``[Tc, k]`` experts of the computed rows (``computed[layer]`` are
    their row indices).
    """

    def __init__(
        self,
        reuse: Tensor | None = None,
        stored: dict[int, Tensor] | None = None,
        cold: Tensor | None = None,
    ) -> None:
        if reuse is not None and bool(reuse.any()) and stored is None:
            raise ValueError("stored: needed when some rows are reused")
        self.reuse, self.stored, self.cold = reuse, stored, cold
        self.outputs: dict[int, Tensor] = {}
        self.experts: dict[int, Tensor] = {}
        self.choice: dict[int, Tensor] = {}
        self.computed: dict[int, Tensor] = {}

    def __call__(self, layer: int, block: DecoderBlock, x: Tensor) -> Tensor:
        # the router is checked once, when a decoder or engine is built (check_team_router)
        moe = block.ffn
        cfg = moe.config.router
        T = x.shape[0]
        compute = (
            ~self.reuse
            if self.reuse is not None
            else torch.ones(T, dtype=torch.bool, device=x.device)
        )
        rows = compute.nonzero().squeeze(1)
        xc = x[rows]
        logits = moe.router.logits(xc)
        scores = router_scores(logits, cfg.score_func)
        w, idx = topk_weights(logits, scores, moe.router.expert_bias, cfg)
        if self.cold is not None:
            cold = self.cold[rows]
            if bool(cold.any()) and not bool(cold.all()):
                if not (
                    cfg.score_func == "softmax"
                    and cfg.softmax_before_topk
                    and not cfg.expert_bias
                    and cfg.n_group is None
                ):
                    raise InvalidValueError(
                        "router: limited activation needs softmax-before-top-k routing without "
                        f"bias or groups (layer {block.layer_idx})"
                    )
                active = torch.zeros(cfg.num_experts, dtype=torch.bool, device=x.device)
                active[idx[~cold].reshape(-1)] = True
                wc, ic = limited_topk(scores[cold], active, cfg.top_k, cfg.norm_topk_prob)
                w, idx = w.clone(), idx.clone()
                w[cold] = wc * cfg.routed_scaling_factor
                idx[cold] = ic
        k = cfg.top_k
        plan = RoutingPlan(
            token_idx=torch.arange(xc.shape[0], device=x.device).repeat_interleave(k),
            expert_idx=idx.reshape(-1),
            weight=w.reshape(-1),
            logits=logits,
            probs=scores,
            num_experts=cfg.num_experts,
            top_k=k,
        )
        d = moe.dispatcher.dispatch(xc, plan)
        yc = moe.dispatcher.combine(moe.experts(d.x, d.counts), d, xc.shape[0])
        if moe.shared_expert is not None:
            yc = yc + moe.shared_expert(xc).to(yc.dtype)
        y = torch.empty(T, x.shape[1], dtype=yc.dtype, device=x.device)
        y[rows] = yc
        if self.reuse is not None and bool(self.reuse.any()):
            y[self.reuse] = self.stored[layer][self.reuse].to(y.dtype)
        used = torch.zeros(cfg.num_experts, dtype=torch.bool, device=x.device)
        used[idx.reshape(-1)] = True
        self.outputs[layer], self.experts[layer] = y, used
        self.choice[layer], self.computed[layer] = idx, rows
        return y

    def experts_per_layer(self) -> list[int]:
        """Distinct experts activated in each MoE layer of this forward (APF's numerator)."""
        return [int(self.experts[i].sum()) for i in sorted(self.experts)]
