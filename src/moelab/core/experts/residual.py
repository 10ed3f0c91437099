"""Residual-MLP experts: each expert is one post-LN Transformer block on a single token.

MoLF's velocity experts (``TransformerExpert`` in the authors' ``models/flow_matching.py``,
susuhu/MoLF; MoLF, ICML 2026, arXiv 2602.02282) are ``Linear(D → H) + LayerNorm``,
one post-LN ``nn.TransformerEncoderLayer`` (GELU feed-forward) applied to a length-1 sequence,
and ``Linear(H → out)``. Self-attention over one token is exactly ``W_o(W_v h + b_v) + b_o``
(the softmax over a single key is 1), so each expert is a residual MLP block::

    h0 = LN_in(x·W_in + b_in)                       W_in  [E, D, H]
    h1 = LN_1(h0 + drop(h0·W_attn + b_attn))        W_attn [E, H, H]  (W_v·W_o folded)
    a  = gelu(h1·W_1 + b_1)                         W_1   [E, H, F]
    h2 = LN_2(h1 + drop(drop(a)·W_2 + b_2))         W_2   [E, F, H]
    y  = h2·W_out + b_out                           W_out [E, H, D]

``W_v·W_o`` is folded into one ``H × H`` map (the same function class with fewer parameters;
this project's choice). The output has the input's width ``D``, the contract of every bank
(:class:`moelab.core.layer.MoELayer` returns ``[..., D]``); MoLF's per-expert output
projection to the latent is recovered by a shared linear map after the combine, which commutes
with the weighted sum (``Σ w_e (y_e·P) = (Σ w_e y_e)·P``), so each expert's effective output
map ``W_out[e]·P`` is any ``H → out`` map when ``D >= out``.

The bank has the row interface :class:`~moelab.core.layer.MoELayer` uses
(``forward(x_ND, counts, return_activations)``, ``num_experts``, ``config``, ``backend``,
``expert_output``, ``select_experts``); set it as ``layer.experts``. Every parameter is
stacked over experts on dim 0, so pruning and expert parallelism cut it like an
:class:`~moelab.core.experts.bank.ExpertBank`. Each call syncs once with the device (the
per-expert row counts, as the loop grouped matmul does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core.autocast import autocast_inputs
from moelab.core.config import ExpertsConfig
from moelab.core.experts.grouped_mm import grouped_mm
from moelab.core.experts.select import take_experts
from moelab.errors import InvalidValueError

_LN_EPS = 1e-5  # nn.LayerNorm's default, as the authors' blocks use


class ResidualMLPExpertBank(nn.Module):
    """E residual-MLP experts (see the module docstring) computed on rows sorted by expert.

    Args:
        config: ``hidden_size`` D (input and output width), ``ffn_hidden_size`` F (the
            feed-forward width), ``init_std`` (normal init of the weight matrices; biases 0,
            LayerNorm weights 1 and biases 0). ``activation`` must be ``"gelu"`` (exact erf,
            ``F.gelu`` as the authors' ``activation=F.gelu``); biases are always present.
        num_experts: E.
        model_size: H, the block's width (MoLF: 256).
        dropout: dropout probability of the attention and feed-forward paths in training
            (MoLF: 0.1; ``nn.TransformerEncoderLayer``'s three dropout sites).
        backend: grouped-matmul backend (``"auto"``, ``"torch"`` or ``"loop"``).

    Raises:
        InvalidValueError: another activation, LoRA adapters, ``model_size < 1`` or
            ``dropout`` outside ``[0, 1)``.
    """

    def __init__(
        self,
        config: ExpertsConfig,
        num_experts: int,
        *,
        model_size: int,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if config.activation != "gelu":
            raise InvalidValueError(
                f"activation: residual-MLP experts use 'gelu', got {config.activation!r}"
            )
        if config.lora_rank:
            raise InvalidValueError("lora_rank: residual-MLP experts take no LoRA adapters")
        if not (isinstance(model_size, int) and model_size >= 1):
            raise InvalidValueError(f"model_size: must be an int >= 1, got {model_size!r}")
        if not 0.0 <= dropout < 1.0:
            raise InvalidValueError(f"dropout: must be in [0, 1), got {dropout!r}")
        self.config = config
        self.num_experts = num_experts
        self.model_size = model_size
        self.dropout = dropout
        self.backend = backend
        E, D, H, Fh = num_experts, config.hidden_size, model_size, config.ffn_hidden_size
        shapes = {"in": (D, H), "attn": (H, H), "1": (H, Fh), "2": (Fh, H), "out": (H, D)}
        for name, (i, o) in shapes.items():
            w = nn.Parameter(torch.empty(E, i, o))
            nn.init.normal_(w, std=config.init_std)
            self.register_parameter(f"w_{name}", w)
            self.register_parameter(f"b_{name}", nn.Parameter(torch.zeros(E, o)))
        for name in ("in", "attn", "ffn"):
            self.register_parameter(f"ln_{name}_weight", nn.Parameter(torch.ones(E, H)))
            self.register_parameter(f"ln_{name}_bias", nn.Parameter(torch.zeros(E, H)))

    def select_experts(self, index: Tensor) -> ResidualMLPExpertBank:
        """A copy holding only the experts ``index`` (``[n]`` int64, in that order); see
        :func:`moelab.core.experts.select.take_experts`."""

        def build(n: int) -> ResidualMLPExpertBank:
            return ResidualMLPExpertBank(
                self.config,
                n,
                model_size=self.model_size,
                dropout=self.dropout,
                backend=self.backend,
            )

        return take_experts(self, index, self.num_experts, build)

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def _ln(self, x: Tensor, name: str, rows: Tensor) -> Tensor:
        """LayerNorm with each row's expert's affine parameters."""
        w, b = getattr(self, f"ln_{name}_weight"), getattr(self, f"ln_{name}_bias")
        x = F.layer_norm(x, (x.shape[-1],), eps=_LN_EPS)
        return x * w[rows].to(x.dtype) + b[rows].to(x.dtype)

    def _linear(self, x: Tensor, name: str, counts: Tensor, rows: Tensor) -> Tensor:
        _, w, b = autocast_inputs(x, getattr(self, f"w_{name}"), getattr(self, f"b_{name}"))
        return grouped_mm(x, w, counts, self.backend) + b[rows]

    def forward(
        self, x_ND: Tensor, counts: Tensor, return_activations: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply expert e to its block of rows.

        Args:
            x_ND: ``[N, D]`` rows sorted by expert.
            counts: ``[E]`` int64 rows per expert (sums to N).
            return_activations: also return the feed-forward activations ``gelu(h1·W_1 + b_1)``
                ``[N, F]``, row-aligned with ``x_ND``.
        Returns:
            ``[N, D]`` expert outputs in the rows' order, or ``(outputs, activations)``.
        """
        (x_ND,) = autocast_inputs(x_ND)
        rows = torch.repeat_interleave(
            torch.arange(self.num_experts, device=x_ND.device), counts, output_size=x_ND.shape[0]
        )
        h0 = self._ln(self._linear(x_ND, "in", counts, rows), "in", rows)
        h1 = self._ln(h0 + self._drop(self._linear(h0, "attn", counts, rows)), "attn", rows)
        a = F.gelu(self._linear(h1, "1", counts, rows))
        ff = self._linear(self._drop(a), "2", counts, rows)
        h2 = self._ln(h1 + self._drop(ff), "ffn", rows)
        y = self._linear(h2, "out", counts, rows)
        return (y, a) if return_activations else y

    def expert_output(self, x_TD: Tensor, expert: int) -> Tensor:
        """Output of one expert on all tokens ``[T, D]`` (analysis: expert redundancy).

        Raises:
            InvalidValueError: ``expert`` outside ``[0, E)``.
        """
        if not 0 <= expert < self.num_experts:
            raise InvalidValueError(f"expert: must be in [0, {self.num_experts}), got {expert}")
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x_TD.device)
        counts[expert] = x_TD.shape[0]
        return self(x_TD, counts)


def residual_expert_parameters(hidden_size: int, model_size: int, ffn_hidden_size: int) -> int:
    """Parameters of one residual-MLP expert (weights, biases, LayerNorms):
    ``2DH + H² + 2HF`` weights, ``H + H + F + H + D`` biases and ``3 · 2H`` LayerNorm values."""
    D, H, Fh = hidden_size, model_size, ffn_hidden_size
    return 2 * D * H + H * H + 2 * H * Fh + (3 * H + Fh + D) + 6 * H
