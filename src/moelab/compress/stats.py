"""Streaming float64 statistics of MoE layers on calibration text (memory independent of the
number of calibration tokens).

Per MoE layer (:class:`LayerStats`):

- input / output first and second moments → covariances ``C = E[h hᵀ] − μ μᵀ`` (the output is
  the MoE block output, shared expert included, as RaGEP's Mixtral script hooks it);
- per expert: routed pair count (frequency), sum of combine weights (soft frequency) and
  ``Σ ‖g·f_e(x)‖₂`` over routed pairs (RaGEP's energy; divided by the count it is REAP's
  saliency, since ``g ≥ 0``);
- optionally per expert the direction moments of the gate-weighted outputs
  ``u = o/‖o‖``, ``o = g·f_e(x)`` (``Σ u`` and ``Σ u uᵀ``; RaGEP's Spectral-Salience), which
  cost ``E·D²`` float64 per layer.

:func:`collect_stats` fills them with one pass of :func:`moelab.compress.calibration.route`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.compress.calibration import expert_outputs, route, routed_pairs
from moelab.core.layer import MoELayer, MoEOutput
from moelab.errors import InvalidValueError
from moelab.models.hooks import moe_layers

_F64 = torch.float64


class LayerStats:
    """Streaming sums of one MoE layer (all float64 except the int64 counts).

    Attributes:
        n_tokens: tokens seen.
        sum_in, sum_out: ``[D]`` Σ of the layer inputs / outputs.
        sum_in_outer, sum_out_outer: ``[D, D]`` Σ h hᵀ of inputs / outputs.
        counts: ``[E]`` int64 routed pairs per expert.
        gate_sum: ``[E]`` Σ combine weights of the routed pairs.
        energy: ``[E]`` Σ ``‖g·f_e(x)‖₂`` over routed pairs.
        dir_sum: ``[E, D]`` Σ u (only with ``directions``).
        dir_outer: ``[E, D, D]`` Σ u uᵀ (only with ``directions``).
    """

    def __init__(self, num_experts: int, d_model: int, *, directions: bool = False) -> None:
        E, D = num_experts, d_model
        self.num_experts, self.d_model = E, D
        self.n_tokens = 0
        self.sum_in = torch.zeros(D, dtype=_F64)
        self.sum_out = torch.zeros(D, dtype=_F64)
        self.sum_in_outer = torch.zeros(D, D, dtype=_F64)
        self.sum_out_outer = torch.zeros(D, D, dtype=_F64)
        self.counts = torch.zeros(E, dtype=torch.int64)
        self.gate_sum = torch.zeros(E, dtype=_F64)
        self.energy = torch.zeros(E, dtype=_F64)
        self.directions = directions
        self.dir_sum = torch.zeros(E, D, dtype=_F64) if directions else None
        self.dir_outer = torch.zeros(E, D, D, dtype=_F64) if directions else None

    @torch.no_grad()
    def update(self, layer: MoELayer, x: Tensor, out: MoEOutput) -> None:
        """Add one layer call: input ``x`` ``[..., D]`` and its output (plan included)."""
        x_TD = x.reshape(-1, x.shape[-1])
        y_TD = out.hidden_states.reshape(-1, x.shape[-1])
        xi, yo = x_TD.to(_F64).cpu(), y_TD.to(_F64).cpu()
        self.n_tokens += x_TD.shape[0]
        self.sum_in += xi.sum(0)
        self.sum_out += yo.sum(0)
        self.sum_in_outer += xi.T @ xi
        self.sum_out_outer += yo.T @ yo
        pairs = routed_pairs(layer, x_TD, out.plan)
        E = self.num_experts
        e = pairs.expert_idx.cpu()
        self.counts += torch.bincount(e, minlength=E)
        self.gate_sum.index_add_(0, e, pairs.weight.to(_F64).cpu())
        o = expert_outputs(layer, pairs).to(_F64).cpu() * pairs.weight.to(_F64).cpu()[:, None]
        self.energy.index_add_(0, e, o.norm(dim=-1))
        if self.directions:
            u = F.normalize(o, dim=-1)
            self.dir_sum.index_add_(0, e, u)
            for j, block in enumerate(u.split(pairs.counts.tolist())):
                if block.shape[0]:
                    self.dir_outer[j] += block.T @ block

    def covariance(self, which: str = "output") -> Tensor:
        """``[D, D]`` float64 ``E[h hᵀ] − μ μᵀ`` of the layer ``"input"`` or ``"output"``.

        Raises:
            ValueError: unknown ``which`` or no token seen.
        """
        if which not in ("input", "output"):
            raise InvalidValueError(f"which: must be 'input' or 'output', got {which!r}")
        if self.n_tokens == 0:
            raise InvalidValueError(
                "covariance: no calibration token was routed through this layer"
            )
        s, ss = (
            (self.sum_in, self.sum_in_outer)
            if which == "input"
            else (self.sum_out, self.sum_out_outer)
        )
        mu = s / self.n_tokens
        return ss / self.n_tokens - torch.outer(mu, mu)

    def direction_covariance(self, expert: int) -> Tensor:
        """``[D, D]`` float64 ``E[u uᵀ] − E[u] E[u]ᵀ`` over expert ``expert`` 's routed pairs
        (zeros when it received none).

        Raises:
            ValueError: the stats were collected without ``directions``.
        """
        if not self.directions:
            raise InvalidValueError("direction_covariance: collected without directions=True")
        n = int(self.counts[expert])
        if n == 0:
            return torch.zeros(self.d_model, self.d_model, dtype=_F64)
        mu = self.dir_sum[expert] / n
        return self.dir_outer[expert] / n - torch.outer(mu, mu)


def collect_stats(
    model: nn.Module,
    batches: Iterable[Tensor],
    *,
    layers: Sequence[int] | None = None,
    directions: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> list[LayerStats | None]:
    """One calibration pass filling :class:`LayerStats` for the chosen MoE layers.

    Args:
        model: the model (its layers may have different expert counts).
        batches: ``[B, S]`` int64 ids.
        layers: MoE-layer indices to collect (None = all); the pass stops after the deepest.
        directions: also collect the per-expert direction moments (``E·D²`` per layer).
        on_batch: progress callback with the tokens of each batch.
    Returns:
        One entry per MoE layer: its stats, or None when not collected.
    Raises:
        ValueError: dense model or a layer index out of range.
    """
    all_layers = moe_layers(model)
    if not all_layers:
        raise InvalidValueError("model: has no MoE layer (a dense model cannot be calibrated)")
    wanted = sorted(set(range(len(all_layers)) if layers is None else layers))
    for i in wanted:
        if not 0 <= i < len(all_layers):
            raise InvalidValueError(
                f"layers: MoE layer {i} out of range [0, {len(all_layers) - 1}]"
            )
    stats: list[LayerStats | None] = [None] * len(all_layers)
    for i in wanted:
        layer = all_layers[i]
        stats[i] = LayerStats(
            layer.experts.num_experts, layer.config.experts.hidden_size, directions=directions
        )

    def observe(i: int, layer: MoELayer, x: Tensor, out: MoEOutput) -> None:
        if stats[i] is not None:
            stats[i].update(layer, x, out)

    route(model, batches, observe, upto_layer=wanted[-1] if wanted else None, on_batch=on_batch)
    return stats
