"""Pre-norm decoder block: ``x + Attn(Norm(x))`` then ``+ FFN(Norm(·))`` (MoE or dense)."""

from __future__ import annotations

from torch import Tensor, nn

from moelab.core.latent_moe import MultiHeadLatentMoE
from moelab.core.layer import MoELayer
from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord
from moelab.models.attention import Attention, KVCache
from moelab.models.config import ModelConfig
from moelab.models.ffn import SwiGLUFFN
from moelab.models.norm import RMSNorm
from moelab.models.rope import RotaryEmbedding


class DecoderBlock(nn.Module):
    """One pre-norm (Llama-style) decoder block.

    ``h = x + attn(attn_norm(x))``; ``out = h + ffn(ffn_norm(h))`` where ``ffn`` is a
    :class:`moelab.core.layer.MoELayer` when ``cfg.is_moe_layer(layer_idx)`` and a dense
    :class:`SwiGLUFFN` of width ``cfg.dense_ffn_size`` otherwise.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            rope,
            layer_idx,
            bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.norm_eps,
        )
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn: nn.Module
        if self.is_moe and cfg.moe is not None:  # is_moe_layer is False without cfg.moe
            self.ffn = MoELayer(cfg.moe_config(layer_idx))
        elif cfg.latent_moe is not None and layer_idx >= cfg.first_dense_layers:
            self.ffn = MultiHeadLatentMoE(cfg.latent_moe, cfg.d_model)  # returns a tensor
        else:
            self.ffn = SwiGLUFFN(cfg.d_model, cfg.dense_ffn_size)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        start_pos: int | Tensor = 0,
        return_plan: bool = False,
        loss_div_factor: float | Tensor | None = None,
        segment_ids: Tensor | None = None,
    ) -> (
        tuple[Tensor, dict[str, Tensor], RoutingRecord | None]
        | tuple[Tensor, dict[str, Tensor], RoutingRecord | None, RoutingPlan | None]
    ):
        """``x [B, S, D]`` → ``(x', aux_losses, record)``; dense blocks give ``({}, None)``.

        ``mask [B, S]`` bool (True = real token) goes to the MoE layer so padding is
        excluded from its losses and telemetry; ``attn_mask`` is the prebuilt attention mask.
        With ``return_plan`` a fourth item is the MoE layer's RoutingPlan (graph kept; None
        for dense blocks), which model-level losses (cross-layer) read. ``loss_div_factor``
        goes to the MoE layer (aux losses normalised by the batch's real tokens), and so do
        ``segment_ids`` (packed documents; :mod:`moelab.models.packing`).
        """
        h = x + self.attn(
            self.attn_norm(x), attn_mask=attn_mask, kv_cache=kv_cache, start_pos=start_pos
        )
        if self.is_moe:
            state = (
                kv_cache.routing_state(self.layer_idx, self.ffn.router, start_pos)
                if kv_cache is not None and self.ffn.needs_prefix_state
                else None
            )
            out = self.ffn(
                self.ffn_norm(h),
                mask=mask,
                prefix_state=state,
                loss_div_factor=loss_div_factor,
                segment_ids=segment_ids,
            )
            if return_plan:
                return h + out.hidden_states, dict(out.aux_losses), out.record, out.plan
            return h + out.hidden_states, dict(out.aux_losses), out.record
        y = h + self.ffn(self.ffn_norm(h))
        return (y, {}, None, None) if return_plan else (y, {}, None)
