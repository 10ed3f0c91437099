"""Decoder-only MoE transformer language model (Llama-style blocks, MoE feed-forwards)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.core import checks
from moelab.core.config import CAUSAL_SCOPES
from moelab.core.latent_moe import MultiHeadLatentMoE
from moelab.core.layer import MoELayer
from moelab.core.losses import CrossLayerLoss
from moelab.core.plan import RoutingPlan
from moelab.core.telemetry import RoutingRecord
from moelab.errors import InvalidValueError
from moelab.models.attention import KVCache, causal_mask
from moelab.models.block import DecoderBlock
from moelab.models.config import ModelConfig
from moelab.models.ffn import SwiGLUFFN
from moelab.models.linear import Linear
from moelab.models.memory import check_model_fits
from moelab.models.norm import RMSNorm
from moelab.models.packing import document_attention_mask, segment_ids
from moelab.models.rope import RotaryEmbedding


def _check_ids(input_ids: Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise InvalidValueError(
            f"input_ids: must be an integer tensor [B, S], got {input_ids.dtype} "
            f"{tuple(input_ids.shape)}"
        )


@dataclass
class LMOutput:
    """What one forward pass of :class:`MoETransformer` returns.

    Attributes:
        logits: ``[B, S, V]`` next-token logits (model dtype).
        aux_loss: fp32 scalar, the sum of every layer's aux losses (coefficients already
            applied by the layers); 0 for a dense model.
        aux_losses: name → fp32 scalar summed over layers (e.g. ``"load_balance"``,
            ``"z_loss"``, ``"specialization"``), plus the model-level ``"cross_layer"``.
        records: one entry per layer: the MoE layer's RoutingRecord, None for dense layers.
        hidden_states: ``[B, S, D]`` final hidden states (after the final norm).
        plans: one entry per layer: the MoE layer's RoutingPlan (graph kept), None for dense
            layers.
    """

    logits: Tensor
    aux_loss: Tensor
    aux_losses: dict[str, Tensor] = field(default_factory=dict)
    records: list[RoutingRecord | None] = field(default_factory=list)
    hidden_states: Tensor | None = None
    plans: list[RoutingPlan | None] = field(default_factory=list)


@dataclass
class LMLoss:
    """What :meth:`MoETransformer.loss` returns.

    Attributes:
        loss: ``ce + aux_loss``, the fp32 scalar to back-propagate.
        ce: mean next-token cross-entropy in nats per counted target token (fp32 scalar).
        aux_loss: fp32 scalar sum of the aux losses (see :class:`LMOutput`).
        num_tokens: number of target tokens counted in ``ce``, a 0-d int64 tensor (reading
            it with ``int()`` syncs with the device).
        output: the forward pass's :class:`LMOutput`.
    """

    loss: Tensor
    ce: Tensor
    aux_loss: Tensor
    num_tokens: Tensor
    output: LMOutput


class MoETransformer(nn.Module):
    """Token embedding → ``n_layers`` pre-norm decoder blocks → RMSNorm → LM head.

    Blocks are :class:`DecoderBlock` (GQA attention with RoPE + MoE or dense SwiGLU FFN).
    With ``tie_embeddings`` the LM head shares ``embed.weight`` ``[V, D]``.

    Initialisation (:meth:`reset_parameters`; GPT-2 / Megatron convention): every weight
    matrix (embedding, attention projections, FFN and expert matrices, router) is drawn from
    ``N(0, init_std²)``, except the projections that write into the residual stream —
    ``attn.o_proj``, the dense FFN's ``w_down`` and the MoE layer's down projections (every
    parameter whose name contains ``down``) — which use ``init_std / sqrt(2·n_layers)`` so the
    residual stream's variance does not grow with depth (two residual writes per block).
    Attention q/k/v biases (``attention_bias``) are zeros.
    Norm weights (including ``qk_norm``'s) are ones; the MoE layer's 1-D parameters and buffers keep the layer's own
    initialisation. ``ExpertsConfig.init_std`` is overridden by ``ModelConfig.init_std``.

    Causality and caching hold exactly for dropless token-choice routing (each token's
    output depends on that token alone); expert-choice routing or capacity dropping couple
    tokens of a batch, so future tokens can then change past outputs. USMoE routing
    (``kind="usmoe"``) with the ``sequence``/``batch`` scopes selects over whole sequences, so
    the KV-cache path refuses it (``ValueError``); its ``position`` and ``causal_prefix``
    scopes are causal and decode incrementally (the cache carries causal-prefix router state).
    Expert-choice routing is refused by the KV-cache path too: one token at a time, every
    expert would take it (capacity 1), a different model from the one trained.

    The forward pass reads no tensor value on the host (no device sync) unless
    :mod:`moelab.core.checks` are enabled: then token ids are range-checked and router logits
    checked for NaN/Inf.

    With ``moe.losses.cross_layer`` the model adds the cross-layer dependency loss
    (:class:`moelab.core.losses.CrossLayerLoss`) over adjacent MoE layers' plans.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg: expected ModelConfig, got {type(cfg).__name__}")
        if torch.get_default_device().type != "meta":
            check_model_fits(cfg, torch.tensor([], dtype=torch.get_default_dtype()).element_size())
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(DecoderBlock(cfg, i, self.rope) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()
        losses = cfg.moe.losses if cfg.moe is not None else None
        self.cross_layer_loss = (
            CrossLayerLoss(losses.cross_layer_variant)
            if losses is not None and losses.cross_layer and cfg.num_moe_layers >= 2
            else None
        )

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> MoETransformer:
        return cls(cfg)

    # ----------------------------------------------------------------- init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter (see the class docstring for the rule)."""
        std = self.cfg.init_std
        resid_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.embed.weight, 0.0, std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, 0.0, std)
        self.norm.reset_parameters()
        for block in self.blocks:
            block.attn_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                nn.init.normal_(proj.weight, 0.0, std)
                if proj.bias is not None:
                    nn.init.zeros_(proj.bias)
            for qk_norm in (block.attn.q_norm, block.attn.k_norm):
                if qk_norm is not None:
                    qk_norm.reset_parameters()
            nn.init.normal_(block.attn.o_proj.weight, 0.0, resid_std)
            if isinstance(block.ffn, SwiGLUFFN):
                nn.init.normal_(block.ffn.w_gate.weight, 0.0, std)
                nn.init.normal_(block.ffn.w_up.weight, 0.0, std)
                nn.init.normal_(block.ffn.w_down.weight, 0.0, resid_std)
            elif isinstance(block.ffn, MultiHeadLatentMoE):
                block.ffn.reset_parameters(std, resid_std)
            elif isinstance(block.ffn, MoELayer):
                for name, p in block.ffn.named_parameters():
                    if p.dim() < 2 or name.rsplit(".", 1)[-1].startswith(("b_", "lora_")):
                        continue  # 1-D parameters, expert biases, LoRA keep the layer's init
                    is_down = "down" in name.rsplit(".", 1)[-1]
                    nn.init.normal_(p, 0.0, resid_std if is_down else std)

    # -------------------------------------------------------------- caching
    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """A :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` positions
        (default and maximum ``cfg.max_seq_len``), on the model's device and dtype."""
        cfg = self.cfg
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not isinstance(max_len, int) or not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(
                f"max_len: must be an int in [1, max_seq_len={cfg.max_seq_len}], got {max_len!r}"
            )
        p = self.embed.weight
        return KVCache(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            max_len,
            cfg.head_dim,
            dtype=p.dtype,
            device=p.device,
        )

    # -------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: Tensor,
        mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        start_pos: int | Tensor = 0,
        loss_div_factor: float | Tensor | None = None,
        doc_ids: Tensor | None = None,
        logits_at: Tensor | None = None,
    ) -> LMOutput:
        """Next-token logits for ``input_ids`` at positions ``start_pos .. start_pos+S-1``.

        Args:
            input_ids: ``[B, S]`` integer token ids in ``[0, vocab_size)``.
            mask: ``[B, S]`` bool, True = real token; padding is never attended to and is
                excluded from the MoE losses/telemetry. ``None`` = all real. Positions are
                not shifted for left padding (RoPE uses the absolute slot index).
            kv_cache: from :meth:`new_kv_cache`; this call's keys/values are stored at
                ``start_pos`` and attention also covers the cached positions before it.
            start_pos: absolute position of ``input_ids[:, 0]``; must be 0 without a cache
                and ``<= kv_cache.length`` with one. With a cache that tracks each row
                (``moelab.serve.SlotKVCache``, continuous batching) it may be an int64 ``[B]``
                tensor of per-row positions.
            loss_div_factor: real tokens of the whole batch over micro-batches (OLMo-core);
                the aux losses become sums over this call's real tokens divided by it
                (:mod:`moelab.core.losses.normalise`). None = per-call means.
            doc_ids: ``[B, S]`` integer document id of each position for packed sequences
                (contiguous runs within a row): attention stays within a document and the
                sequence-level balance loss is per document (:mod:`moelab.models.packing`).
                Not with ``kv_cache``.
            logits_at: int64 ``[B]``: compute logits only at this index of each row (a
                prefill needs just each prompt's last position; the LM head over every
                position costs ``S·D·V`` multiply-adds). ``logits`` is then ``[B, 1, V]``;
                ``hidden_states`` stays ``[B, S, D]``. None = every position.

        Raises:
            ValueError: bad shapes/dtypes, positions beyond ``max_seq_len`` or the cache,
                ids out of range (only with :mod:`moelab.core.checks` enabled; otherwise the
                embedding raises ``IndexError`` on CPU), or a block-diffusion model
                (``cfg.objective``), which has no causal path.
        """
        cfg = self.cfg
        if cfg.objective != "causal":
            raise ValueError(
                f"model: a {cfg.objective} model (block_size={cfg.block_size}) has no causal "
                "next-token path; use moelab.models.block_diffusion (train/evaluate) or the "
                "diffusion decoders (moelab generate --decoder vanilla|team)"
            )
        _check_ids(input_ids)
        B, S = input_ids.shape
        if S < 1:
            raise ValueError("input_ids: needs at least one position")
        if (
            checks.value_checks()
            and input_ids.numel()
            and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size)
        ):
            raise ValueError(f"input_ids: ids must be in [0, vocab_size={cfg.vocab_size})")
        if logits_at is not None and (
            logits_at.shape != (B,)
            or logits_at.dtype != torch.long
            or (checks.value_checks() and bool(((logits_at < 0) | (logits_at >= S)).any()))
        ):
            raise ValueError(
                f"logits_at: must be int64 [{B}] indices in [0, {S}), got {logits_at.dtype} "
                f"{tuple(logits_at.shape)}"
            )
        if mask is not None and (mask.shape != input_ids.shape or mask.dtype != torch.bool):
            raise ValueError(
                f"mask: must be bool {tuple(input_ids.shape)}, got {mask.dtype} {tuple(mask.shape)}"
            )
        if isinstance(start_pos, Tensor):
            if kv_cache is None:
                raise ValueError("start_pos: per-row positions need a kv_cache")
            if start_pos.shape != (B,) or start_pos.dtype != torch.long:
                raise ValueError(
                    f"start_pos: per-row positions must be int64 [{B}], got "
                    f"{start_pos.dtype} {tuple(start_pos.shape)}"
                )
            first, last = (int(v) for v in torch.aminmax(start_pos))
        elif isinstance(start_pos, int):
            first = last = start_pos
        else:
            raise ValueError(f"start_pos: must be an int >= 0, got {start_pos!r}")
        if first < 0:
            raise ValueError(f"start_pos: must be >= 0, got {first}")
        if last + S > cfg.max_seq_len:
            raise ValueError(
                f"start_pos: positions up to {last + S - 1} exceed max_seq_len={cfg.max_seq_len}"
            )
        if kv_cache is not None:
            self._check_cacheable()
        if kv_cache is None:
            if last != 0:
                raise ValueError(
                    "start_pos: must be 0 without a kv_cache holding earlier positions"
                )
            key_mask = mask
        else:
            if kv_cache.n_layers != cfg.n_layers:
                raise ValueError(f"kv_cache: has {kv_cache.n_layers} layers, model {cfg.n_layers}")
            kv_cache.check(B, start_pos, S)
            key_mask = kv_cache.advance(start_pos, mask, S)
        attn_mask = causal_mask(S, start_pos, key_mask, input_ids.device)
        segments = None
        if doc_ids is not None:
            if kv_cache is not None:
                raise ValueError("doc_ids: packed documents cannot be decoded with a kv_cache")
            if doc_ids.shape != input_ids.shape or doc_ids.is_floating_point():
                raise ValueError(
                    f"doc_ids: must be an integer tensor {tuple(input_ids.shape)}, got "
                    f"{doc_ids.dtype} {tuple(doc_ids.shape)}"
                )
            attn_mask = document_attention_mask(doc_ids, attn_mask)
            segments = segment_ids(doc_ids)

        x = self.embed(input_ids)
        aux_losses: dict[str, Tensor] = {}
        records: list[RoutingRecord | None] = []
        plans: list[RoutingPlan | None] = []
        for block in self.blocks:
            x, layer_aux, record, plan = block(
                x,
                mask=mask,
                attn_mask=attn_mask,
                kv_cache=kv_cache,
                start_pos=start_pos,
                return_plan=True,
                loss_div_factor=loss_div_factor,
                segment_ids=segments,
            )
            for name, value in layer_aux.items():
                v = value.float()
                aux_losses[name] = aux_losses[name] + v if name in aux_losses else v
            records.append(record)
            plans.append(plan)
        if self.cross_layer_loss is not None:
            moe_plans = [p for p in plans if p is not None]
            token_mask = mask.reshape(-1) if mask is not None else None
            ks = [b.ffn.config.router.top_k for b in self.blocks if b.is_moe]
            cross = self.cfg.moe.losses.cross_layer_coeff * self.cross_layer_loss(
                moe_plans, token_mask, ks
            )
            if loss_div_factor is not None:
                n = input_ids.numel() if mask is None else mask.sum()
                cross = cross * n / loss_div_factor
            aux_losses["cross_layer"] = cross
        h = self.norm(x)
        logits = self._head(h, logits_at)
        aux_loss = torch.zeros((), dtype=torch.float32, device=logits.device)
        for value in aux_losses.values():
            aux_loss = aux_loss + value
        return LMOutput(
            logits=logits,
            aux_loss=aux_loss,
            aux_losses=aux_losses,
            records=records,
            hidden_states=h,
            plans=plans,
        )

    def _head(self, h: Tensor, logits_at: Tensor | None) -> Tensor:
        """LM head on the final-normed states ``h [B, S, D]`` (only at ``logits_at`` if given)."""
        if logits_at is None:
            logits = self.lm_head(h)
        else:
            rows = torch.arange(h.shape[0], device=h.device)
            logits = self.lm_head(h[rows, logits_at].unsqueeze(1))
        if self.cfg.logit_scale != 1.0:  # a tied model grown by SPARKLING (App. D.1)
            logits = logits * self.cfg.logit_scale
        return logits

    # ------------------------------------------------- cached-prefix forward
    def _check_start(self, block: int, name: str) -> None:
        if self.cfg.objective != "causal":
            raise InvalidValueError(
                f"model: a {self.cfg.objective} model has no causal path to run from a block"
            )
        if isinstance(block, bool) or not isinstance(block, int):
            raise InvalidValueError(
                f"{name}: must be an int in [0, {self.cfg.n_layers}], got {block!r}"
            )
        if not 0 <= block <= self.cfg.n_layers:
            raise InvalidValueError(f"{name}: must be in [0, {self.cfg.n_layers}], got {block}")

    def _run_blocks(self, x: Tensor, mask: Tensor | None, start: int, stop: int) -> Tensor:
        if mask is not None and (mask.shape != x.shape[:2] or mask.dtype != torch.bool):
            raise InvalidValueError(
                f"mask: must be bool {tuple(x.shape[:2])}, got {mask.dtype} {tuple(mask.shape)}"
            )
        attn_mask = causal_mask(x.shape[1], 0, mask, x.device)
        for block in self.blocks[start:stop]:
            x = block(x, mask=mask, attn_mask=attn_mask)[0]
        return x

    def hidden_at(self, input_ids: Tensor, mask: Tensor | None = None, *, block: int) -> Tensor:
        """Hidden states entering block ``block`` (0: the embeddings; ``n_layers``: the last
        block's output, before the final norm), ``[B, S, D]`` in the model dtype, computed
        under ``torch.no_grad`` as a cache for :meth:`forward_from` (methods that change only
        the top blocks, e.g. knowledge editing, run the frozen lower ones once).

        Args:
            input_ids: ``[B, S]`` token ids; positions start at 0 (no KV cache).
            mask: ``[B, S]`` bool, True = real token (right padding).
        Raises:
            InvalidValueError: ``block`` outside ``[0, n_layers]``, a non-causal model, a
                mask of another shape; the checks of :meth:`forward` on ``input_ids``.
        """
        self._check_start(block, "block")
        _check_ids(input_ids)
        if input_ids.shape[1] > self.cfg.max_seq_len:
            raise InvalidValueError(
                f"input_ids: {input_ids.shape[1]} positions exceed max_seq_len={self.cfg.max_seq_len}"
            )
        with torch.no_grad():
            return self._run_blocks(self.embed(input_ids), mask, 0, block)

    def advance(
        self, hidden: Tensor, mask: Tensor | None = None, *, start_block: int, stop_block: int
    ) -> Tensor:
        """Run blocks ``start_block .. stop_block-1`` on ``hidden [B, S, D]`` (the states
        entering ``start_block``) → the states entering ``stop_block``, ``[B, S, D]``.

        ``advance(hidden_at(ids, mask, block=a), mask, start_block=a, stop_block=b)`` equals
        ``hidden_at(ids, mask, block=b)`` bit for bit, so layer-wise methods (sequential
        pruning) can carry a calibration set's states up the model once instead of
        recomputing the lower blocks for every layer. Gradients flow as the caller's mode
        allows; MoE aux losses and routing records are not returned (forward hooks still run).

        Raises:
            InvalidValueError: a block index outside ``[0, n_layers]``, ``stop_block`` below
                ``start_block``, ``hidden`` not ``[B, S, d_model]``, a mask of another shape,
                a non-causal model.
        """
        self._check_start(start_block, "start_block")
        self._check_start(stop_block, "stop_block")
        if stop_block < start_block:
            raise InvalidValueError(
                f"stop_block: must be >= start_block={start_block}, got {stop_block}"
            )
        self._check_hidden(hidden)
        return self._run_blocks(hidden, mask, start_block, stop_block)

    def _check_hidden(self, hidden: Tensor) -> None:
        if (
            not isinstance(hidden, Tensor)
            or hidden.dim() != 3
            or hidden.shape[-1] != self.cfg.d_model
        ):
            raise InvalidValueError(
                f"hidden: expected a [B, S, {self.cfg.d_model}] tensor, got "
                f"{tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}"
            )

    def forward_from(
        self,
        hidden: Tensor,
        mask: Tensor | None = None,
        *,
        start_block: int,
        logits_at: Tensor | None = None,
    ) -> Tensor:
        """Run blocks ``start_block .. n_layers-1``, the final norm and the LM head on
        ``hidden [B, S, D]`` (the states entering ``start_block``, from :meth:`hidden_at`) →
        logits ``[B, S, V]`` (``[B, 1, V]`` with ``logits_at``, as in :meth:`forward`).

        ``forward_from(hidden_at(ids, mask, block=k), mask, start_block=k)`` equals
        ``forward(ids, mask).logits`` bit for bit. MoE aux losses and routing records of the
        recomputed blocks are not returned (use :meth:`forward` to train routers).

        Raises:
            InvalidValueError: ``start_block`` outside ``[0, n_layers]``, ``hidden`` not
                ``[B, S, d_model]``, a mask of another shape, a non-causal model.
        """
        self._check_start(start_block, "start_block")
        self._check_hidden(hidden)
        x = self._run_blocks(hidden, mask, start_block, self.cfg.n_layers)
        return self._head(self.norm(x), logits_at)

    def noncausal_routing_layers(self) -> list[int]:
        """Indices of MoE layers whose USMoE routing looks at future tokens (``sequence`` or
        ``batch`` selection scope): with any of them the model is not a causal LM."""
        return [
            block.layer_idx
            for block in self.blocks
            if block.is_moe
            and block.ffn.config.router.kind == "usmoe"
            and block.ffn.config.router.selection_scope not in CAUSAL_SCOPES
        ]

    def _check_cacheable(self) -> None:
        """Refuse the KV-cache (incremental decoding) path for routers that look at other
        positions of the sequence (USMoE ``sequence``/``batch`` scopes, expert choice).
        Raises ValueError."""
        for block in self.blocks:
            if block.is_moe and block.ffn.config.router.kind == "expert_choice":
                raise InvalidValueError(
                    f"kv_cache: layer {block.layer_idx} routes with expert choice, where each "
                    "expert picks its tokens among all tokens of the batch; decoding one token "
                    "at a time would give every expert a capacity of 1, a different model from "
                    "the one trained; score such a model with full sequences (moelab eval) or "
                    "swap in a token-choice router (moelab.models.with_router) to generate"
                )
        bad = self.noncausal_routing_layers()
        if bad:
            scope = self.blocks[bad[0]].ffn.config.router.selection_scope
            raise InvalidValueError(
                f"kv_cache: layer {bad[0]} routes with USMoE over the whole sequence "
                f"(selection_scope={scope!r}), which looks at future tokens and is not valid for "
                "causal generation; swap in selection_scope='position' or 'causal_prefix' "
                "(moelab.models.with_router) or a token-choice router to generate"
            )

    def loss(
        self,
        input_ids: Tensor,
        targets: Tensor,
        mask: Tensor | None = None,
        ignore_index: int = -100,
        loss_div_factor: float | Tensor | None = None,
        doc_ids: Tensor | None = None,
    ) -> LMLoss:
        """Cross-entropy of ``targets`` under the model, plus the aux losses.

        Args:
            input_ids: ``[B, S]`` inputs.
            targets: ``[B, S]`` the token that should follow each input position (already
                shifted by the caller); ``ignore_index`` entries are not counted.
            mask: ``[B, S]`` bool, True = real token; False positions are neither attended
                to nor counted.
            loss_div_factor: the counted target tokens of the whole batch over all
                micro-batches (OLMo-core's ``loss_div_factor``): ``ce = Σ ce_t /
                loss_div_factor`` and the aux losses are normalised the same way, so the
                micro-batch losses *sum* to the full-batch loss (exactly for ce and z-loss,
                see :mod:`moelab.core.losses.normalise`). None = means over this call.
            doc_ids: packed documents (see :meth:`forward`); the caller masks the target
                of each document's last position (it belongs to the next document).

        Returns:
            :class:`LMLoss`: ``ce`` in nats per counted token (fp32, 0 when none counted),
            ``loss = ce + aux_loss``.
        """
        if targets.shape != input_ids.shape:
            raise ValueError(
                f"targets: must have shape {tuple(input_ids.shape)}, got {tuple(targets.shape)}"
            )
        out = self(input_ids, mask=mask, loss_div_factor=loss_div_factor, doc_ids=doc_ids)
        tgt = targets.long()
        if mask is not None:
            tgt = tgt.masked_fill(~mask, ignore_index)
        counted = tgt != ignore_index
        n = counted.sum()
        ce_sum = F.cross_entropy(
            out.logits.float().flatten(0, 1),
            tgt.flatten(),
            ignore_index=ignore_index,
            reduction="sum",
        )
        ce = ce_sum / (n.clamp_min(1) if loss_div_factor is None else loss_div_factor)
        return LMLoss(
            loss=ce + out.aux_loss, ce=ce, aux_loss=out.aux_loss, num_tokens=n, output=out
        )
