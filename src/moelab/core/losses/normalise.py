"""Aux losses normalised by the global number of tokens (OLMo-core's ``loss_div_factor``).

Each aux loss of a layer call is a mean over the call's n real tokens (balance losses: through
P, the mean router probability; z-loss: mean of ``logsumexp²``). With gradient accumulation
those means are usually averaged over micro-batches, which weighs a token of a short (or
heavily padded) micro-batch more than one of a long one. Given the number N of real tokens of
the whole batch, :func:`global_token_normalised` rescales every loss to ``n · loss / N``:

- the router z-loss becomes ``Σ_t z_t / N``: summed over micro-batches it is *exactly* the
  full-batch z-loss, whatever the padding (as the cross-entropy ``Σ_t ce_t / N`` is);
- a balance loss ``E · Σ_i f_i P_i`` becomes ``E · Σ_i f_i Σ_t p_ti / N``, OLMo-core's
  ``local_batch`` granularity: the token-weighted mean of the micro-batch losses, with f
  (a count, not differentiable) taken per micro-batch — or from the step's accumulated counts
  with ``load_balance="global"``. It equals the full-batch loss exactly when the micro-batches
  route the same fractions f (e.g. one micro-batch), not in general: the full-batch f is only
  known after the last micro-batch.

Coefficient convention (per layer, Megatron-Core / OLMo-core): every MoE layer computes its
own losses with its own coefficients (``LossConfig.aux_loss_coeff``...), and the model sums
them over layers (no division by the number of layers, unlike transformers' pooled
``load_balancing_loss_func``). A model with L MoE layers therefore adds L times a layer's
loss; scale the coefficient by 1/L to match a pooled convention.
"""

from __future__ import annotations

from torch import Tensor


def global_token_normalised(
    losses: dict[str, Tensor], token_mask: Tensor, loss_div_factor: float | Tensor
) -> dict[str, Tensor]:
    """``{name: n · loss / loss_div_factor}`` with ``n = token_mask.sum()``.

    Args:
        losses: per-token-mean aux losses of one layer call (float32 scalars).
        token_mask: ``[T]`` bool real tokens of the call.
        loss_div_factor: N, real tokens of the whole batch (> 0; a float or 0-d tensor).
    Returns:
        The rescaled losses (float32 scalars; no host sync).
    """
    n = token_mask.sum().float()
    return {name: loss * n / loss_div_factor for name, loss in losses.items()}
