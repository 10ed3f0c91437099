"""Multi-Head LatentMoE (Cui et al., "Multi-Head LatentMoE and Head Parallel: Communication-
Efficient and Deterministic MoE Parallelism", ICML 2026, arXiv 2602.04870; authors' module
``MHMoEHPNRT`` in kerner-lab/Sparse-GPT-Pretraining, read for understanding, not copied).

``y = fc_mg(concat_h Σ_{e ∈ topk_h} g_{h,e} · expert_{h,e}(s_h))`` with sub-tokens
``s_h = fc_mh(x)[h·d_h:(h+1)·d_h]``:

1. ``fc_mh``: D → H·d_h (no bias), split into H sub-tokens of width d_h.
2. Head dispatch: a :class:`LocalHeadDispatcher` keeps every head here; the Head Parallel
   dispatcher (:mod:`moelab.parallel.head_parallel`) sends each head's sub-tokens to the rank
   that owns the head with one fixed, equal-split all-to-all (no metadata, independent of k).
3. Per head h, nothing shared across heads: router ``R_h [E, d_h]`` in float32, selection
   top-k of ``logits + b_h`` (aux-loss-free bias), gates = softmax over the k selected
   *clean* logits (bias removed); E GELU experts ``GELU(s·K_e)·V_e`` of hidden size m.
4. The reverse head dispatch, concatenation of the heads, ``fc_mg``: H·d_h → D (no bias).
5. Bias balancing after each optimizer step, per (head, expert): load = fraction of the
   head's k-assignments, ``u = sign(mean(load) − load)``, ``u ← u − mean(u)``, ``b += γ·u``
   (:meth:`MultiHeadLatentMoE.update_bias`).

Follows the authors' code: steps 1–5, bias-free projections, init N(0, 0.02²) for fc_mh, K,
V and (our choice, unstated) the routers, N(0, (0.02/√(2L))²) for fc_mg, no aux loss.

moelab's choices (labelled):
- The experts of all local heads are one :class:`moelab.core.experts.ExpertBank` of H·E GELU
  experts (expert ``h·E + e``) fed by the shared sort-by-expert dispatch
  (:func:`moelab.core.dispatch.dispatch_uniform`); sub-token ``(t, h)`` is row ``t·H + h``.
  The paper's IO-aware FlexAttention expert kernel ("reversal trick") and its streaming
  top-k routing kernel are GPU kernels and are NOT implemented; a fused path replaces
  ``MultiHeadLatentMoE.experts`` (same ``[rows, d_h]`` sorted-by-expert contract).
- ``top_k = 1`` is allowed (the authors assert k >= 2: with one selected logit the gate is
  identically 1 and the router learns only through its bias).
- γ defaults to 0.1 = 50 × moelab's default peak lr 2e-3 (the authors use γ = 50 × max_lr).
- Counts for the bias update are accumulated during training forwards (grad enabled, module
  in training mode) and consumed by :meth:`update_bias`; the layer takes no padding mask (the
  training loop has no padding), so every sub-token counts.
- The layer returns a plain tensor and no RoutingRecord (moelab's routing analysis reads
  token-level records and does not cover this layer yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moelab.core.config import ExpertsConfig
from moelab.core.dispatch import LocalDispatcher, dispatch_uniform
from moelab.core.experts import ExpertBank
from moelab.core.experts.select import carry_over
from moelab.errors import InvalidTypeError, InvalidValueError, require

BIAS_RATE_PER_LR = 50.0
"""The authors' bias update rate per unit of peak learning rate (``launch_training.py``)."""


@dataclass
class LatentMoEConfig:
    """One Multi-Head LatentMoE feed-forward layer (the model width D comes from the model).

    Attributes:
        num_heads: H, sub-tokens per token (>= 1).
        head_dim: d_h, width of a sub-token (>= 1). The authors pair H·d_h with D.
        num_experts: E, experts per head (>= 1).
        top_k: k, experts per sub-token, in [1, E].
        expert_size: m, hidden size of every GELU expert (the authors use multiples of 128
            for their kernels; any m >= 1 here).
        bias_update_rate: γ of the per-head aux-loss-free bias update (>= 0), or None (the
            default): :data:`BIAS_RATE_PER_LR` × the training run's peak learning rate, as
            the authors tie it (``auxfree_update_ratio = 50.0 * lrsched_max_lr``,
            ``launch_training.py``) [C]; ``moelab train`` passes that rate to
            :meth:`MultiHeadLatentMoE.update_bias`.
        init_std: std of the normal init (fc_mh, routers, K, V; fc_mg uses
            ``init_std / sqrt(2·n_layers)``, set by the model).
    """

    num_heads: int = 4
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 128
    bias_update_rate: float | None = None
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "num_experts", "expert_size"):
            v = getattr(self, name)
            require(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                name,
                f"must be an int >= 1, got {v!r}",
            )
        k, E = self.top_k, self.num_experts
        require(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= E,
            "top_k",
            f"must be an int in [1, num_experts={E}], got {k!r}",
        )
        rate = self.bias_update_rate
        require(
            rate is None or (isinstance(rate, (int, float)) and rate >= 0),
            "bias_update_rate",
            f"must be >= 0, got {self.bias_update_rate!r}",
        )
        require(
            isinstance(self.init_std, (int, float)) and self.init_std > 0,
            "init_std",
            f"must be > 0, got {self.init_std!r}",
        )

    def active_params(self, d_model: int) -> int:
        """Weights one token uses: ``2·D·H·d_h + H·(d_h·E + k·2·d_h·m)`` (projections,
        routers, k experts per head)."""
        H, dh = self.num_heads, self.head_dim
        return 2 * d_model * H * dh + H * (
            dh * self.num_experts + self.top_k * 2 * dh * self.expert_size
        )


class LocalHeadDispatcher:
    """Every head on this process: the head exchange is the identity.

    ``scatter(s [T, H, d_h]) -> [T, H, d_h]`` and ``gather`` likewise. ``bias_group()`` is
    the group whose counts a bias update sums: all data-parallel ranks when
    ``torch.distributed`` is initialised (each sees other tokens), else None (local).
    """

    head_offset = 0

    def scatter(self, s_THd: Tensor) -> Tensor:
        return s_THd

    def gather(self, y_THd: Tensor) -> Tensor:
        return y_THd

    def bias_group(self):
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class MultiHeadLatentMoE(nn.Module):
    """Multi-Head LatentMoE feed-forward layer (see the module docstring for the maths).

    Args:
        config: heads, experts and bias settings.
        d_model: D, the model width.
        dispatcher: head dispatcher (default :class:`LocalHeadDispatcher`).

    Parameters (with ``H_l`` local heads, H_l = H unless sharded by Head Parallel):
        fc_mh.weight ``[H·d_h, D]``; fc_mg.weight ``[D, H·d_h]``;
        router ``[H_l, E, d_h]`` (float32 maths); experts.w_up ``[H_l·E, d_h, m]``,
        experts.w_down ``[H_l·E, m, d_h]``.
    Buffers:
        expert_bias ``[H_l, E]`` float32 selection bias (updated by :meth:`update_bias`).

    Forward:
        x ``[..., D]`` float → ``[..., D]`` same dtype. Every rank of a Head Parallel group
        must pass the same number of tokens.
    Raises:
        ValueError: x's last dimension is not D, or x contains NaN/Inf (router logits).
    """

    def __init__(
        self, config: LatentMoEConfig, d_model: int, dispatcher: LocalHeadDispatcher | None = None
    ) -> None:
        super().__init__()
        if not isinstance(config, LatentMoEConfig):
            raise InvalidTypeError(f"config: expected LatentMoEConfig, got {type(config).__name__}")
        self.config = config
        self.d_model = d_model
        H, dh, E = config.num_heads, config.head_dim, config.num_experts
        self.num_local_heads = H
        self.fc_mh = nn.Linear(d_model, H * dh, bias=False)
        self.fc_mg = nn.Linear(H * dh, d_model, bias=False)
        self.router = nn.Parameter(torch.empty(H, E, dh))
        self.register_buffer("expert_bias", torch.zeros(H, E))
        experts_cfg = ExpertsConfig(
            hidden_size=dh, ffn_hidden_size=config.expert_size, activation="gelu"
        )
        self.experts = ExpertBank(experts_cfg, H * E)
        self.head_dispatcher = dispatcher or LocalHeadDispatcher()
        self._counts: Tensor | None = None
        self.reset_parameters(config.init_std, config.init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float, resid_std: float) -> None:
        """``N(0, std²)`` for fc_mh, routers, K and V; ``N(0, resid_std²)`` for fc_mg; bias 0."""
        for p in (self.fc_mh.weight, self.router, self.experts.w_up, self.experts.w_down):
            nn.init.normal_(p, 0.0, std)
        nn.init.normal_(self.fc_mg.weight, 0.0, resid_std)
        self.expert_bias.zero_()

    @torch.no_grad()
    def shard_heads(self, start: int, count: int) -> None:
        """Keep only heads ``[start, start+count)`` of the router, bias and experts (Head
        Parallel); fc_mh and fc_mg stay whole. Raises ValueError for a bad range."""
        H_l, E = self.num_local_heads, self.config.num_experts
        if not (start >= 0 and count >= 1 and start + count <= H_l):
            raise InvalidValueError(f"heads: [{start}, {start + count}) is not inside [0, {H_l})")
        self.router = carry_over(self.router[start : start + count].detach().clone(), self.router)
        self.expert_bias = self.expert_bias[start : start + count].clone()
        self.experts = self.experts.select_experts(torch.arange(start * E, (start + count) * E))
        self.num_local_heads = count

    def route(self, s_SHd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head top-k routing of sub-tokens ``[S, H_l, d_h]``.

        Returns:
            (logits ``[S, H_l, E]`` float32 clean, gates ``[S, H_l, k]`` float32 = softmax of
            the selected clean logits, expert indices ``[S, H_l, k]`` int64 in ``[0, E)``),
            experts in descending order of ``logits + bias``.
        """
        x = s_SHd.to(torch.promote_types(s_SHd.dtype, torch.float32))
        logits = torch.einsum("shd,hed->she", x, self.router.to(x.dtype))
        if not torch.isfinite(logits).all():
            raise InvalidValueError(
                "router logits are not finite: the layer input contains NaN or Inf"
            )
        idx = (logits + self.expert_bias.to(logits.dtype)).topk(self.config.top_k, dim=-1).indices
        gates = logits.gather(-1, idx).softmax(dim=-1)
        return logits, gates, idx

    def heads_forward(self, s_SHd: Tensor) -> Tensor:
        """Route and run the experts of the local heads: ``[S, H_l, d_h]`` → same shape."""
        S, H_l, dh = s_SHd.shape
        E, k = self.config.num_experts, self.config.top_k
        _, gates, idx = self.route(s_SHd)
        expert_idx = (idx + torch.arange(H_l, device=idx.device).view(1, H_l, 1) * E).reshape(-1)
        if torch.is_grad_enabled() and self.training:
            counts = torch.bincount(expert_idx, minlength=H_l * E).view(H_l, E)
            self._counts = counts if self._counts is None else self._counts + counts
        rows = s_SHd.reshape(S * H_l, dh)
        d = dispatch_uniform(rows, expert_idx, gates.reshape(-1), H_l * E, k)
        y = LocalDispatcher().combine(self.experts(d.x, d.counts), d, S * H_l)
        return y.to(s_SHd.dtype).view(S, H_l, dh)

    def forward(self, x: Tensor) -> Tensor:
        D = self.d_model
        if x.dim() < 1 or x.shape[-1] != D:
            raise InvalidValueError(f"x: expected shape [..., {D}], got {tuple(x.shape)}")
        cfg = self.config
        x_TD = x.reshape(-1, D)
        s = self.fc_mh(x_TD).view(-1, cfg.num_heads, cfg.head_dim)
        y = self.head_dispatcher.gather(self.heads_forward(self.head_dispatcher.scatter(s)))
        return self.fc_mg(y.reshape(-1, cfg.num_heads * cfg.head_dim)).reshape(x.shape)

    @torch.no_grad()
    def update_bias(self, rate: float | None = None) -> Tensor | None:
        """Apply the per-(head, expert) bias update from the counts of the training forwards
        since the last call, then forget them. Counts are summed over the dispatcher's
        ``bias_group()`` (the ranks that hold these heads and see other tokens).

        ``u = sign(Σ_j c_j − E·c_i)`` (exact integer form of ``sign(mean load − load)``),
        ``u ← u − mean(u)``, ``b += γ·u``, with γ = ``rate`` when given, else the config's
        ``bias_update_rate``. Returns the bias, or None when nothing was counted.

        Raises:
            InvalidValueError: neither ``rate`` nor ``bias_update_rate`` is set (None means
                "tied to the learning rate": the trainer passes it).
        """
        counts, self._counts = self._counts, None
        if counts is None:
            return None
        group = self.head_dispatcher.bias_group()
        if group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=group)
        E = self.config.num_experts
        u = torch.sign(counts.sum(-1, keepdim=True) - E * counts).to(self.expert_bias.dtype)
        u = u - u.mean(-1, keepdim=True)
        gamma = self.config.bias_update_rate if rate is None else rate
        if gamma is None:
            raise InvalidValueError(
                "bias_update_rate: None ties it to the learning rate; pass rate= "
                f"({BIAS_RATE_PER_LR:g} × the peak learning rate, as moelab train does)"
            )
        self.expert_bias.add_(gamma * u)
        return self.expert_bias
