"""SAME's MoE-LoRA layer (Prism's ``SAMELinear``, ``PEFT/tuners/custom/same.py`` @ 7154be2a;
``wave3-continual.md`` §3.1) on :class:`~moelab.models.adapters.bilinear_lora.BilinearMoELoRALinear`.

Routing [C]:

* training: ``ḡ = mean over the batch's real tokens of softmax(x W_Gᵀ)``, masked by the
  freezing masks and renormalised (``_same_forward_with_routing``, ``_get_masked_routing``);
  one ``[E]`` vector for the whole batch;
* inference: per sample, ``ḡ = mean over its tokens of softmax(x W_Gᵀ / E)``, then the top-k
  of ``ḡ ⊙ π`` renormalised (``_apply_topk_sparsification``), π the task prior (ones when
  off). The authors evaluate one sample at a time; a batch here is routed row by row.

Stabilisers [C]:

* **router hook** (``_spectral_aware_router_hook``): from ``start_step`` training forwards on,
  the router gradient ``G [E, in]`` becomes ``G V diag(c) Vᵀ + G (I − V Vᵀ)``, V the top-k*
  columns of the current range-finder basis U (k* = #{cumulative energy of S² <= 0.9} + 1),
  ``c = clamp(s/max s, 1 − ρ, 1 + ρ)`` with ``s = 1/(S̃ + 1e-6)``, S̃ S smoothed over a trailing
  window. The gradient changes only inside span(V), the current batch's principal input
  directions; nothing protects an old task's subspace.
* **range finder** (``_update_router_covariance``): on the first forward of a task and every
  ``refresh_every`` forwards, with centred inputs X: ``U = qr(Xᵀ X Q)``, Q ~ N(0, 1)
  ``[in, m]``, ``S = ‖(X U)_col‖ / √(N − 1)`` (the columns' std, not sorted).
* **curvature hook** on the A experts (``_make_curvature_hook``), tasks >= 1 with a valid
  end-of-task snapshot (U_p, S_p): ``G ← G (U_k diag(1/(S_p,k + μ)) U_kᵀ + (1/μ)(I − U_k U_kᵀ))``
  (the complement *up*-scaled by 1/μ).
* **freezing** (``_update_activation_metrics``, ``_apply_adaptive_freezing``): EMAs (0.95) of
  utilisation ``mean softmax`` and importance ``mean softmax·‖x‖²``; ``score = minmax(u) −
  minmax(ι)``; experts with ``score < τ`` are masked out of the training routing, never the
  current task's ``min(t, E−1)``; once all others are masked the masks stop updating. Masked
  experts get zero gradient but stay trainable (no ``requires_grad`` change).
* **per task** (:meth:`SAMELinear.begin_task`): each task is a fresh process in Prism, so
  utilisation (1/E), masks (ones), the all-frozen flag, the step counter and the running
  U, S restart; the snapshot (U_p, S_p, valid), importance and the weights carry over.
  :meth:`SAMELinear.end_task` takes the snapshot (``save_task_covariance_snapshot``).

Activation checkpointing: the statistics, counters and telemetry update only on the first
forward of a step, never on a recompute. Prism looks for torch's checkpoint frames on the
stack; here a forward that runs while autograd executes a backward (where every recompute
runs, reentrant or not) is recognised by ``torch._C._current_graph_task_id() != -1``. The
gradient hooks live on the parameters, so they fire once per backward either way. The
training routing reads the freezing masks, which the first pass updates after using them; a
recompute reuses the first pass's masks (Prism's recompute reads the updated ones, so its
recomputed graph can differ from the first pass's).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moelab.methods.continual.same_settings import SAMESettings
from moelab.models.adapters.bilinear_lora import BilinearMoELoRALinear


def in_backward() -> bool:
    """True while autograd runs a backward pass (an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def energy_rank(S: Tensor, ratio: float) -> int:
    """k* = #{cumsum(S²)/ΣS² <= ratio} + 1, clamped to ``[1, len(S)]`` [C]."""
    e = S.double() ** 2
    cum = torch.cumsum(e, 0) / (e.sum() + 1e-10)
    return max(1, min(int((cum <= ratio).sum()) + 1, S.numel()))


def router_scales(S: Tensor, window: int, spread: float) -> Tensor:
    """``c [k]``: ``s = 1/(S̃ + 1e-6)`` with S̃ the trailing ``window`` mean, ``clamp(s/max s,
    1 − spread, 1 + spread)`` [C]."""
    smooth = torch.stack([S[max(0, i - window + 1) : i + 1].mean() for i in range(S.numel())])
    s = 1.0 / (smooth + 1e-6)
    return torch.clamp(s / s.max(), 1.0 - spread, 1.0 + spread)


class SAMELinear(BilinearMoELoRALinear):
    """SAME's layer (module docstring).

    Args:
        base: the frozen ``nn.Linear``.
        num_experts: E (one per task [C]).
        settings: SAME's knobs (rank, α, init, stabilisers, top-k).

    Buffers (in the state dict): ``cov_U [in, m]``, ``cov_S [m]``, ``cov_U_prev``,
    ``cov_S_prev``, ``cov_prev_valid`` (bool), ``utilization [E]``, ``importance [E]``,
    ``expert_masks [E]``. Attributes: ``cur_task``, ``current_step``, ``all_frozen``.
    Forward:
        ``x [B, S, in]`` (or ``[T, in]``), ``token_mask [B, S]`` bool (real tokens; all by
        default), ``prior [B, E]`` or ``[E]`` (inference only; ones by default) →
        ``[..., out]``. :attr:`last_weights` holds the combine weights (``[E]`` in training,
        ``[B, E]`` at inference) and :attr:`last_record` their record.
    """

    def __init__(self, base: nn.Linear, num_experts: int, settings: SAMESettings) -> None:
        super().__init__(base, num_experts, settings.rank, settings.alpha, 0.0, settings.init_std)
        self.settings = settings
        d, E = base.in_features, num_experts
        m = min(settings.max_components, d)
        for name, shape in (("cov_U", (d, m)), ("cov_S", (m,))):
            self.register_buffer(name, torch.zeros(shape))
            self.register_buffer(f"{name}_prev", torch.zeros(shape))
        self.register_buffer("cov_prev_valid", torch.tensor(False))
        self.register_buffer("utilization", torch.full((E,), 1.0 / E))
        self.register_buffer("importance", torch.full((E,), 1.0 / E))
        self.register_buffer("expert_masks", torch.ones(E))
        self.cur_task = 0
        self.current_step = 0
        self.all_frozen = False
        self._step_masks = self.expert_masks.clone()
        self.router.weight.register_hook(self._router_hook)
        self.lora_A.register_hook(self._curvature_hook)

    # -- task boundaries --------------------------------------------------------------------
    def begin_task(self, t: int) -> None:
        """Reset the per-task state as a fresh Prism process does (module docstring)."""
        self.cur_task = t
        self.current_step = 0
        self.all_frozen = False
        self.utilization.fill_(1.0 / self.num_experts)
        self.expert_masks.fill_(1.0)
        self.cov_U.zero_()
        self.cov_S.zero_()

    @torch.no_grad()
    def end_task(self) -> None:
        """Snapshot the last range-finder estimate as (U_p, S_p) for the next task's
        curvature hook (``save_task_covariance_snapshot`` [C])."""
        k = int((self.cov_S > 1e-10).sum())
        if k == 0:
            self.cov_prev_valid.fill_(False)
            return
        self.cov_U_prev.zero_()
        self.cov_S_prev.zero_()
        self.cov_U_prev[:, :k] = self.cov_U[:, :k]
        self.cov_S_prev[:k] = self.cov_S[:k]
        self.cov_prev_valid.fill_(True)

    @property
    def current_expert(self) -> int:
        return min(self.cur_task, self.num_experts - 1)

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self, x: Tensor, token_mask: Tensor | None = None, prior: Tensor | None = None
    ) -> Tensor:
        if token_mask is None:
            token_mask = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        logits = self.router(x.to(self.router.weight.dtype)).float()
        first_pass = not in_backward()
        if self.training:
            real = x[token_mask]
            probs = torch.softmax(logits[token_mask], dim=-1)  # [N, E]
            if first_pass:
                self._update_range_finder(real.detach().float())
                # a recompute must route as the first pass did, before the freezing update
                self._step_masks = self.expert_masks.clone()
            g = self._masked(probs.mean(0), self._step_masks)
            if first_pass:
                self.current_step += 1
                with torch.no_grad():
                    self._update_metrics(probs.detach(), real.detach().float())
                    if self.settings.freezing and not self.all_frozen:
                        self._apply_freezing()
                self.record(g)
            delta = self.combine(x, g)
        else:
            probs = torch.softmax(logits / self.num_experts, dim=-1)
            m = token_mask.unsqueeze(-1).to(probs.dtype)
            mean = (probs * m).sum(-2) / m.sum(-2).clamp_min(1.0)  # [..., E] per sample
            g = self.sparsify(mean, prior)
            if first_pass:
                self.record(g)
            delta = self.combine(x, g.unsqueeze(-2) if x.dim() == g.dim() + 1 else g)
        return self.base(x) + delta.to(x.dtype)

    def sparsify(self, mean: Tensor, prior: Tensor | None) -> Tensor:
        """Top-k of ``mean ⊙ prior`` renormalised, row-wise (``[..., E]``) [C]."""
        p = mean if prior is None else mean * prior.to(mean)
        p = p / (p.sum(-1, keepdim=True) + 1e-8)
        k = self.settings.top_k
        if k < self.num_experts:
            top, idx = p.topk(k, dim=-1)
            p = torch.zeros_like(p).scatter(-1, idx, top)
            p = p / (p.sum(-1, keepdim=True) + 1e-8)
        return p

    def _masked(self, g: Tensor, masks: Tensor) -> Tensor:
        """``g ⊙ masks`` renormalised; the current expert alone if that leaves nothing [C]."""
        out = g * masks.to(g)
        if float(out.detach().sum()) == 0.0:
            out = out.index_fill(0, torch.tensor(self.current_expert), 1.0)
        return out / out.sum()

    # -- statistics -------------------------------------------------------------------------
    @torch.no_grad()
    def _update_range_finder(self, x: Tensor) -> None:
        """Randomised range finder on the batch (module docstring), on the task's first
        forward and every ``refresh_every`` forwards [C]."""
        if not (self.current_step == 0 or self.current_step % self.settings.refresh_every == 0):
            return
        n, d = x.shape
        xc = x - x.mean(0, keepdim=True)
        q = torch.randn(d, self.cov_U.shape[1])
        U, _ = torch.linalg.qr(xc.T @ (xc @ q), mode="reduced")
        self.cov_U.copy_(U)
        self.cov_S.copy_(torch.sqrt(((xc @ U) ** 2).sum(0) / (n - 1 + 1e-8)))

    def _update_metrics(self, probs: Tensor, x: Tensor) -> None:
        a = self.settings.ema
        self.utilization.mul_(a).add_((1 - a) * probs.mean(0))
        energy = (x**2).sum(-1, keepdim=True)
        self.importance.mul_(a).add_((1 - a) * (probs * energy).mean(0))

    def activation_scores(self) -> Tensor:
        """``minmax(utilization) − minmax(importance)`` ``[E]`` (0 for a constant vector) [C]."""

        def norm(t: Tensor) -> Tensor:
            if t.max() == t.min():
                return torch.zeros_like(t)
            return (t - t.min()) / (t.max() - t.min() + 1e-8)

        return norm(self.utilization) - norm(self.importance)

    def _apply_freezing(self) -> None:
        low = self.activation_scores() < self.settings.tau_score
        low[self.current_expert] = False
        self.expert_masks.copy_((~low).float())
        others = torch.ones_like(low)
        others[self.current_expert] = False
        if bool(low[others].all()):
            self.all_frozen = True

    # -- gradient hooks ---------------------------------------------------------------------
    def _router_hook(self, grad: Tensor) -> Tensor:
        s = self.settings
        if not (s.router_projection and self.training and self.current_step >= s.start_step):
            return grad
        if float((self.cov_S**2).sum()) == 0.0:
            return grad
        k = energy_rank(self.cov_S, s.energy_ratio)
        V = self.cov_U[:, :k].to(grad)
        c = router_scales(self.cov_S[:k].to(grad), s.window, s.router_scaling)
        gv = grad @ V
        return (gv * c) @ V.T + (grad - gv @ V.T)

    def _curvature_hook(self, grad: Tensor) -> Tensor:
        s = self.settings
        if not (s.curvature and self.training and self.cur_task > 0):
            return grad
        if not bool(self.cov_prev_valid):
            return grad
        k = energy_rank(self.cov_S_prev, s.energy_ratio)
        U = self.cov_U_prev[:, :k].to(grad)
        inv = 1.0 / (self.cov_S_prev[:k].to(grad) + s.curvature_mu)
        gu = grad @ U  # [E, r/E, k]
        return (gu * inv) @ U.T + (grad - gu @ U.T) / s.curvature_mu


__all__ = ["SAMELinear", "energy_rank", "in_backward", "router_scales"]
