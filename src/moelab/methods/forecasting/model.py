"""PatchTST-lite with an exchangeable FFN slot: the backbone every TiMi arm shares.

PatchTST (Nie et al., "A Time Series is Worth 64 Words", ICLR 2023; [S] TiMi's time series
side: overlapping patches plus a linear projection): RevIN, one channel, patches of
``patch_len`` every ``patch_stride`` steps, a linear patch embedding plus a learned position
embedding, post-LN Transformer blocks (``a = LN(h + attn(h))``, ``h = LN(a + slot(a))``), and
a flatten head ``Linear(N·D → H)``. The slot is a dense FFN (unimodal, concat) or the MMoE
plug-in (mmoe, tmoe, smoe, shuffled). The concat arm projects the text token to D and appends
it as an extra token, which the attention and the flatten head both see [I].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from moelab.errors import InvalidValueError
from moelab.methods.forecasting.config import ForecastConfig
from moelab.methods.forecasting.mmoe import DenseFFN, MMoE, SlotOutput
from moelab.methods.forecasting.revin import RevIN


@dataclass
class ForecastOutput:
    """Attributes:
    prediction: ``[B, H]`` in the input's units.
    aux_loss: float32 scalar, the MoE balance losses of every block.
    experts: per block, ``{"tmoe"|"smoe": [B, k]}`` int64 experts of each sample.
    """

    prediction: Tensor
    aux_loss: Tensor
    experts: list[dict[str, Tensor]]


class Block(nn.Module):
    """Post-LN block: ``a = LN(h + drop(attn(h)))``, ``h = LN(a + drop(slot(a, text)))``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, slot: nn.Module) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.attn_norm = nn.LayerNorm(d_model)
        self.slot = slot
        self.slot_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: Tensor, text: Tensor | None) -> tuple[Tensor, SlotOutput]:
        a = self.attn_norm(h + self.drop(self.attn(h, h, h, need_weights=False)[0]))
        out = self.slot(a, text)
        return self.slot_norm(a + self.drop(out.hidden_states)), out


class PatchForecaster(nn.Module):
    """One arm of :class:`~moelab.methods.forecasting.config.ForecastConfig`.

    Args:
        config: the arm and sizes.
        text_size: width of the text token (ignored by the text-free arms).
    Forward:
        ``x [B, L]`` float look-back, ``text [B, text_size]`` (the text arms) →
        :class:`ForecastOutput`.
    Raises:
        InvalidValueError: ``x`` not ``[B, lookback]``, or a text arm called without text.
    """

    def __init__(self, config: ForecastConfig, text_size: int) -> None:
        super().__init__()
        c = config
        self.config = config
        D, N = c.d_model, c.num_patches
        self.revin = RevIN()
        self.patch_embed = nn.Linear(c.patch_len, D)
        self.concat = c.arm == "concat"
        self.text_proj = nn.Linear(text_size, D) if self.concat else None
        tokens = N + 1 if self.concat else N
        self.pos = nn.Parameter(torch.randn(tokens, D) * 0.02)
        self.drop = nn.Dropout(c.dropout)

        def slot() -> nn.Module:
            if c.arm in ("unimodal", "concat"):
                return DenseFFN(D, 2 * D)
            return MMoE(
                D,
                N,
                text_size,
                num_experts=c.num_experts,
                top_k=c.top_k,
                aux_loss_coeff=c.aux_loss_coeff,
                use_text=c.arm != "smoe",
                use_series=c.arm != "tmoe",
            )

        self.blocks = nn.ModuleList(
            Block(D, c.n_heads, c.dropout, slot()) for _ in range(c.n_layers)
        )
        self.head = nn.Linear(tokens * D, c.horizon)

    def forward(self, x: Tensor, text: Tensor | None = None) -> ForecastOutput:
        c = self.config
        if x.dim() != 2 or x.shape[1] != c.lookback:
            raise InvalidValueError(f"x: expected [B, {c.lookback}], got {tuple(x.shape)}")
        if c.uses_text and text is None:
            raise InvalidValueError(f"text: the {c.arm!r} arm needs the text token")
        z, stats = self.revin.normalize(x)
        h = self.patch_embed(z.unfold(-1, c.patch_len, c.patch_stride))  # [B, N, D]
        if self.text_proj is not None:
            h = torch.cat([h, self.text_proj(text)[:, None]], dim=1)
        h = self.drop(h + self.pos)
        aux = h.new_zeros((), dtype=torch.float32)
        experts = []
        for block in self.blocks:
            h, out = block(h, text if c.uses_text else None)
            aux = aux + out.aux_loss
            experts.append(out.experts)
        y = self.head(h.flatten(1))
        return ForecastOutput(self.revin.denormalize(y, stats), aux, experts)
