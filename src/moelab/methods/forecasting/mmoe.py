"""TiMi's Multimodal MoE (MMoE) plug-in for a Transformer block's FFN slot.

[S] (the only description of the internals, ``shared/research/wave3-science.md`` §2.1): two
sample-level MoEs in parallel, their outputs summed:

* **TMoE**: routed by the text token alone (a frozen LLM's mean-pooled hidden states); the
  chosen experts serve all temporal tokens of the sample;
* **SMoE**: routed by the concatenation of all temporal tokens (a global view of the series).

Both are moelab :class:`~moelab.core.layer.MoELayer` s whose router scores a per-sample
context instead of the tokens: ``RouterConfig.input_size`` is the context width and the
context is broadcast to every token through ``router_input``, so every token of a sample has
the same logits, hence the same experts and weights (the balance loss on the repeated probs
equals the per-sample loss, each sample weighted by its tokens). [I]: E = 4, k = 2, softmax
over the selected logits, GELU experts ``d → 2d → d`` with biases, Switch balance loss 1e-2,
no z-loss.

A consequence [I]: text reaches the output only through the choice of experts and their
weights, so it can select a regime but not say *where* in the horizon an event lands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError


@dataclass
class SlotOutput:
    """What an FFN-slot module returns.

    Attributes:
        hidden_states: ``[B, N, D]``.
        aux_loss: float32 scalar (0 for a dense FFN).
        experts: ``{"tmoe": [B, k], "smoe": [B, k]}`` int64 experts of each sample (those of
            the MoEs present).
    """

    hidden_states: Tensor
    aux_loss: Tensor
    experts: dict[str, Tensor]


class DenseFFN(nn.Module):
    """The plain Transformer FFN ``Linear(D, F) → GELU → Linear(F, D)``."""

    def __init__(self, d_model: int, ffn_size: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, ffn_size)
        self.down = nn.Linear(ffn_size, d_model)

    def forward(self, h: Tensor, text: Tensor | None = None) -> SlotOutput:
        del text  # the dense FFN ignores the context
        y = self.down(nn.functional.gelu(self.up(h)))
        return SlotOutput(y, h.new_zeros((), dtype=torch.float32), {})


def context_moe(
    d_model: int,
    ffn_size: int,
    context_size: int,
    num_experts: int,
    top_k: int,
    aux_loss_coeff: float,
) -> MoELayer:
    """An MoE layer of GELU experts whose router scores a ``context_size``-wide context."""
    return MoELayer(
        MoEConfig(
            router=RouterConfig(
                num_experts=num_experts,
                top_k=top_k,
                softmax_before_topk=False,
                input_size=context_size,
            ),
            experts=ExpertsConfig(
                hidden_size=d_model, ffn_hidden_size=ffn_size, activation="gelu", bias=True
            ),
            losses=LossConfig(aux_loss_coeff=aux_loss_coeff, z_loss_coeff=0.0),
        )
    )


def routed(moe: MoELayer, h: Tensor, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``moe`` on tokens ``h [B, N, D]`` routed per sample by ``context [B, C]``:
    ``(output [B, N, D], aux loss, experts [B, k])``."""
    B, N, _ = h.shape
    out = moe(h, router_input=context[:, None].expand(B, N, context.shape[-1]))
    k = out.plan.expert_idx.numel() // (B * N)
    experts = out.plan.expert_idx.view(B, N, k)[:, 0]
    aux = sum(out.aux_losses.values(), h.new_zeros((), dtype=torch.float32))
    return out.hidden_states, aux, experts


class MMoE(nn.Module):
    """TMoE + SMoE replacing a block's FFN (see the module docstring).

    Args:
        d_model: D, the token width; experts are ``D → ffn_size → D``.
        num_tokens: N, series tokens per sample (SMoE's router reads ``N·D`` numbers).
        text_size: width of the text token (TMoE's router input).
        use_text, use_series: keep TMoE / SMoE (TiMi: both; the ablations: one).
    Forward:
        ``h [B, N, D]``, ``text [B, text_size]`` float (None only without TMoE) →
        :class:`SlotOutput`.
    Raises:
        InvalidValueError: neither MoE kept; a text-routed forward without ``text``, or
            ``h`` with other than N tokens.
    """

    def __init__(
        self,
        d_model: int,
        num_tokens: int,
        text_size: int,
        *,
        ffn_size: int | None = None,
        num_experts: int = 4,
        top_k: int = 2,
        aux_loss_coeff: float = 1e-2,
        use_text: bool = True,
        use_series: bool = True,
    ) -> None:
        super().__init__()
        if not (use_text or use_series):
            raise InvalidValueError("use_text, use_series: keep at least one of the MoEs")
        F = ffn_size or 2 * d_model
        self.num_tokens = num_tokens
        args = (num_experts, top_k, aux_loss_coeff)
        self.tmoe = context_moe(d_model, F, text_size, *args) if use_text else None
        self.smoe = context_moe(d_model, F, num_tokens * d_model, *args) if use_series else None

    def forward(self, h: Tensor, text: Tensor | None = None) -> SlotOutput:
        B, N, _ = h.shape
        if self.smoe is not None and self.num_tokens != N:
            raise InvalidValueError(f"h: expected {self.num_tokens} tokens, got {N}")
        y = torch.zeros_like(h)
        aux = h.new_zeros((), dtype=torch.float32)
        experts = {}
        if self.tmoe is not None:
            if text is None:
                raise InvalidValueError("text: the text-routed MoE needs the text token")
            out, a, experts["tmoe"] = routed(self.tmoe, h, text)
            y, aux = y + out, aux + a
        if self.smoe is not None:
            out, a, experts["smoe"] = routed(self.smoe, h, h.reshape(B, N * h.shape[-1]))
            y, aux = y + out, aux + a
        return SlotOutput(y, aux, experts)
