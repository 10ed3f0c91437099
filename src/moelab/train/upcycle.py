"""Sparse upcycling: turn a dense moelab model into an MoE model with the same output at step 0.

Sparse upcycling (Komatsuzaki et al. 2023, "Sparse Upcycling: Training Mixture-of-Experts from
Dense Checkpoints", ICLR, arXiv 2212.05055) copies each dense FFN into every expert of a new MoE
layer; everything else (embeddings, attention, norms, LM head) is copied unchanged.
Granular upcycling (He et al. 2024, "Upcycling Large Language Models into Mixture of Experts",
arXiv 2410.07524; Megatron-Core ``--moe-use-upcycling --moe-upcycling-granularity G``,
``megatron/core/transformer/moe/upcycling_utils.py``) first splits the dense FFN's hidden
dimension F into G slices of width F/G and copies the slices: ``num_experts`` copies (E) give
E·G fine-grained experts, and ``top_k`` copies (k) become k·G active experts.

Layout (as Megatron): routed expert ``j = c·G + g`` is slice ``g`` of copy ``c``; slice ``g``
owns hidden units ``[g·F/G, (g+1)·F/G)`` of the dense ``w_gate``, ``w_up`` (rows) and
``w_down`` (columns). Since SwiGLU acts unit by unit, ``FFN(x) = Σ_g slice_g(x)`` exactly.

Why the output is preserved (``upcycled(x) == dense(x)`` up to float rounding):

* G = 1: the k selected experts are identical copies of the FFN and, with normalised top-k
  weights (softmax + ``norm_topk_prob``, softmax after top-k, or sigmoid + ``norm_topk_prob``)
  their weights sum to 1, so ``Σ_i w_i·FFN(x) = FFN(x)`` *whatever the router weights*.
* G > 1 ("virtual group" router initialisation, arXiv 2410.07524 §3; Megatron's
  ``_process_router_param``): the G router rows of copy c are the same random row r_c, so the
  G slices of a copy get bit-identical logits and scores. Top-(k·G) selection over values that
  come in G-fold ties takes the G slices of each of the k best copies — a set of complete
  copies. Each selected slice then has weight ``q_c / G`` with ``Σ_c q_c = 1`` (normalised
  weights), so ``Σ_c Σ_g (q_c/G)·slice_g(x) = FFN(x)/G``; multiplying every expert's
  ``w_down`` by ``G`` (linear, so exact) restores ``FFN(x)``. Megatron spreads this factor as
  ``G^(1/3)`` over the three SwiGLU matrices, which is exact only for degree-1 homogeneous
  activations (silu is not); putting it on ``w_down`` alone is exact for SwiGLU. A
  ``routed_scaling_factor`` s is compensated the same way (``w_down · G / s``).
  Caveat: completeness needs the logits of tied rows to come out bit-identical (true for every
  BLAS that reduces over D in one order for all outputs — the tests check it) and no exact
  tie between two *different* copies at the k-th place (probability zero for random r_c).

Combinations that cannot preserve the output raise ``ValueError``: expert-choice routing or a
capacity factor (tokens may be dropped), un-normalised softmax-before-top-k or sigmoid weights
(they do not sum to 1), group-limited routing (groups need not align with copies), and
``router_init="random"`` with G > 1 (independent rows select incomplete copies).
"""

from __future__ import annotations

import copy as _copy
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from moelab.core.config import ExpertsConfig, LossConfig, MoEConfig, RouterConfig
from moelab.core.layer import MoELayer
from moelab.errors import InvalidValueError
from moelab.models.config import ModelConfig
from moelab.models.ffn import SwiGLUFFN
from moelab.models.transformer import MoETransformer

RouterInit = Literal["virtual_group", "random"]
ROUTER_INITS: tuple[str, ...] = ("virtual_group", "random")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class UpcycleSpec:
    """The sizes of an upcycling, derived and checked by :func:`upcycle_spec`.

    Attributes:
        copies: E, copies of the dense FFN (``num_experts`` argument).
        top_k_copies: k, copies active per token.
        granularity: G, slices per copy.
        num_experts: E·G routed experts of the MoE layer.
        top_k: k·G experts active per token.
        dense_ffn_size: F of the dense model.
        expert_ffn_size: F/G, hidden width of each routed expert.
        down_scale: factor applied to every expert's ``w_down`` (``G / routed_scaling_factor``).
    """

    copies: int
    top_k_copies: int
    granularity: int
    num_experts: int
    top_k: int
    dense_ffn_size: int
    expert_ffn_size: int
    down_scale: float


def upcycle_spec(
    dense_ffn_size: int,
    num_experts: int,
    top_k: int,
    granularity: int = 1,
    router: RouterConfig | None = None,
    router_init: str = "virtual_group",
) -> UpcycleSpec:
    """Check the upcycling arguments and derive the MoE sizes.

    Raises:
        ValueError: naming the argument — ``num_experts`` < 1, ``top_k`` outside
            ``[1, num_experts]``, ``granularity`` < 1 or not dividing F, unknown
            ``router_init``, or a ``router`` setting that cannot preserve the output.
    """
    if not _is_int(num_experts) or num_experts < 1:
        raise InvalidValueError(
            f"num_experts: must be an int >= 1 (copies of the FFN), got {num_experts!r}"
        )
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise InvalidValueError(
            f"top_k: must be an int in [1, num_experts={num_experts}], got {top_k!r}"
        )
    if not _is_int(granularity) or granularity < 1:
        raise InvalidValueError(f"granularity: must be an int >= 1, got {granularity!r}")
    if dense_ffn_size % granularity:
        raise InvalidValueError(
            f"granularity: must divide the dense FFN width {dense_ffn_size}, got {granularity}"
        )
    if router_init not in ROUTER_INITS:
        raise InvalidValueError(f"router_init: must be one of {ROUTER_INITS}, got {router_init!r}")
    if router_init == "random" and granularity > 1:
        raise InvalidValueError(
            "router_init: 'random' gives the G slices of a copy independent router rows, so "
            "top-k·G selection can take incomplete copies and change the output; use "
            "'virtual_group' with granularity > 1"
        )
    r = router or RouterConfig(
        num_experts=num_experts * granularity,
        top_k=top_k * granularity,
        norm_topk_prob=True,  # the copies reproduce the dense FFN only if the weights sum to 1
    )
    if r.kind != "token_choice":
        raise InvalidValueError(
            f"router.kind: upcycling needs token_choice routing, got {r.kind!r}"
        )
    if r.capacity_factor is not None:
        raise InvalidValueError(
            "router.capacity_factor: must be None (dropping tokens changes the output)"
        )
    if r.n_group is not None:
        raise InvalidValueError(
            "router.n_group: group-limited routing is not supported for upcycling"
        )
    normalised = r.norm_topk_prob or (r.score_func == "softmax" and not r.softmax_before_topk)
    if not normalised:
        raise InvalidValueError(
            "router.norm_topk_prob: must be True (or softmax after top-k) so the top-k weights "
            "sum to 1 and the copies reproduce the dense FFN"
        )
    return UpcycleSpec(
        copies=num_experts,
        top_k_copies=top_k,
        granularity=granularity,
        num_experts=num_experts * granularity,
        top_k=top_k * granularity,
        dense_ffn_size=dense_ffn_size,
        expert_ffn_size=dense_ffn_size // granularity,
        down_scale=granularity / r.routed_scaling_factor,
    )


def upcycle_ffn_weights(
    ffn: SwiGLUFFN, copies: int, granularity: int, down_scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Expert-bank weights of E copies of ``ffn`` split into G slices.

    Args:
        ffn: dense SwiGLU FFN, ``w_gate``/``w_up`` ``[F, D]``, ``w_down`` ``[D, F]``.
        copies: E. granularity: G (divides F).
        down_scale: multiplies ``w_down`` (default ``G``; see the module docstring).
    Returns:
        ``w_gate_up [E·G, D, 2F/G]`` (gate block first, then up; input-major) and
        ``w_down [E·G, F/G, D]``, in ``ffn``'s dtype; expert ``c·G + g`` is slice ``g``.
    """
    F_, D = ffn.w_gate.weight.shape
    G = granularity
    if F_ % G:
        raise InvalidValueError(f"granularity: must divide the dense FFN width {F_}, got {G}")
    s = float(G if down_scale is None else down_scale)
    f = F_ // G
    gate = ffn.w_gate.weight.detach().reshape(G, f, D).transpose(1, 2)  # [G, D, f]
    up = ffn.w_up.weight.detach().reshape(G, f, D).transpose(1, 2)  # [G, D, f]
    down = ffn.w_down.weight.detach().T.reshape(G, f, D)  # [G, f, D]
    if s != 1.0:
        down = down * s
    gate_up = torch.cat([gate, up], dim=-1)  # [G, D, 2f]
    return (
        gate_up.repeat(copies, 1, 1).contiguous(),
        down.repeat(copies, 1, 1).contiguous(),
    )


def virtual_group_router_weight(
    copies: int, granularity: int, hidden_size: int, std: float, generator: torch.Generator
) -> Tensor:
    """Router weight ``[E·G, D]`` float32 whose rows ``c·G .. c·G+G-1`` all equal ``r_c``,
    with ``r_c ~ N(0, std²)`` (arXiv 2410.07524's virtual-group initialisation)."""
    rows = torch.randn(copies, hidden_size, generator=generator) * std
    return rows.repeat_interleave(granularity, dim=0)


def upcycle_config(
    dense_cfg: ModelConfig,
    spec: UpcycleSpec,
    router: RouterConfig | None = None,
    losses: LossConfig | None = None,
    first_dense_layers: int = 0,
    moe_layers: tuple[int, ...] | None = None,
) -> ModelConfig:
    """The MoE :class:`ModelConfig` of an upcycled ``dense_cfg`` (same attention/embeddings);
    ``moe_layers`` is an explicit placement (:attr:`ModelConfig.moe_layers`)."""
    r = dataclasses.replace(
        router or RouterConfig(), num_experts=spec.num_experts, top_k=spec.top_k
    )
    moe = MoEConfig(
        router=r,
        experts=ExpertsConfig(
            hidden_size=dense_cfg.d_model,
            ffn_hidden_size=spec.expert_ffn_size,
            activation="swiglu",
            init_std=dense_cfg.init_std,
        ),
        losses=_copy.deepcopy(losses) if losses is not None else LossConfig(),
    )
    return dataclasses.replace(
        dense_cfg,
        moe=moe,
        first_dense_layers=first_dense_layers,
        moe_layers=None if moe_layers is None else tuple(moe_layers),
    )


@torch.no_grad()
def upcycle(
    dense_model: MoETransformer,
    num_experts: int,
    top_k: int,
    granularity: int = 1,
    router_init: RouterInit = "virtual_group",
    seed: int = 0,
    *,
    router: RouterConfig | None = None,
    losses: LossConfig | None = None,
    first_dense_layers: int = 0,
    moe_layers: tuple[int, ...] | list[int] | None = None,
    router_std: float | None = None,
) -> MoETransformer:
    """Sparse (granular) upcycling of a dense model into an output-preserving MoE model.

    Args:
        dense_model: a dense :class:`MoETransformer` (``cfg.moe is None``); not modified.
        num_experts: E, copies of each dense FFN (>= 1). The MoE layer has E·G experts.
        top_k: k, copies active per token (``1 <= k <= E``); the router's top-k is k·G.
        granularity: G, slices of each FFN (divides the FFN width F); experts have width F/G.
        router_init: ``"virtual_group"`` (default): the G rows of a copy share one random
            row (needed for G > 1); ``"random"``: independent rows (G = 1 only).
        seed: seeds the router initialisation (the only random part).
        router: template for the router settings (its ``num_experts``/``top_k`` are replaced
            by E·G and k·G); default ``RouterConfig()`` — softmax, normalised top-k weights.
        losses: router losses of the MoE layers (default ``LossConfig()``); they do not
            change the logits.
        first_dense_layers: keep the first n layers dense (their FFN copied as is).
        moe_layers: upcycle exactly these layers (sorted distinct indices; every other FFN
            is copied as is): selective upcycling. Excludes ``first_dense_layers``.
        router_std: std of the router rows; default ``dense_model.cfg.init_std``.
    Returns:
        A new :class:`MoETransformer` (same dtype and device, eval mode if the dense model
        was) whose logits equal the dense model's up to float rounding (module docstring).
    Raises:
        TypeError: ``dense_model`` is not a MoETransformer.
        ValueError: naming the argument (see :func:`upcycle_spec`), a model that is already
            MoE, or ``first_dense_layers`` out of range.
    """
    if not isinstance(dense_model, MoETransformer):
        raise TypeError(f"dense_model: expected MoETransformer, got {type(dense_model).__name__}")
    cfg = dense_model.cfg
    if cfg.moe is not None:
        raise InvalidValueError(
            "dense_model: already has MoE layers (cfg.moe is set); upcycle a dense model"
        )
    if not _is_int(first_dense_layers) or not 0 <= first_dense_layers < cfg.n_layers:
        raise InvalidValueError(
            f"first_dense_layers: must be an int in [0, n_layers={cfg.n_layers}), "
            f"got {first_dense_layers!r}"
        )
    if not _is_int(seed):
        raise InvalidValueError(f"seed: must be an int, got {seed!r}")
    spec = upcycle_spec(cfg.dense_ffn_size, num_experts, top_k, granularity, router, router_init)
    moe_cfg = upcycle_config(cfg, spec, router, losses, first_dense_layers, moe_layers)
    std = cfg.init_std if router_std is None else router_std
    if not std > 0:
        raise InvalidValueError(f"router_std: must be > 0, got {router_std!r}")

    ref = dense_model.embed.weight
    with torch.device("meta"):
        moe = MoETransformer(moe_cfg)
    moe = moe.to_empty(device=ref.device).to(ref.dtype)
    if moe_cfg.tie_embeddings:
        moe.lm_head.weight = moe.embed.weight

    dense_sd = dense_model.state_dict()
    new_sd: dict[str, Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for i, block in enumerate(moe.blocks):
        if not isinstance(block.ffn, MoELayer):
            continue
        dense_ffn = dense_model.blocks[i].ffn
        if not isinstance(dense_ffn, SwiGLUFFN):
            raise InvalidValueError(f"dense_model: block {i} has no dense SwiGLU FFN")
        w_gate_up, w_down = upcycle_ffn_weights(
            dense_ffn, spec.copies, spec.granularity, spec.down_scale
        )
        p = f"blocks.{i}.ffn."
        new_sd[p + "experts.w_gate_up"] = w_gate_up
        new_sd[p + "experts.w_down"] = w_down
        if router_init == "virtual_group":
            w_r = virtual_group_router_weight(spec.copies, spec.granularity, cfg.d_model, std, gen)
        else:
            w_r = torch.randn(spec.num_experts, cfg.d_model, generator=gen) * std
        new_sd[p + "router.weight"] = w_r
        if getattr(block.ffn.router, "expert_bias", None) is not None:
            new_sd[p + "router.expert_bias"] = torch.zeros(spec.num_experts)
    target = moe.state_dict()
    for name in target:
        if name in new_sd:
            continue
        if name not in dense_sd:
            raise InvalidValueError(
                f"dense_model: no source for parameter {name!r} of the MoE model"
            )
        new_sd[name] = dense_sd[name]
    moe.load_state_dict(new_sd, strict=True)
    moe.train(dense_model.training)
    return moe


@torch.no_grad()
def max_logit_diff(a: MoETransformer, b: MoETransformer, input_ids: Tensor) -> float:
    """``max |logits_a - logits_b|`` over ``input_ids [B, S]`` (compared in float64).

    :func:`upcycle` promises this is at float-rounding level for a dense model and its
    upcycled MoE model.
    """
    la = a(input_ids).logits.double()
    lb = b(input_ids).logits.double()
    return float((la - lb).abs().max())


@torch.no_grad()
def selects_complete_copies(moe: MoETransformer, input_ids: Tensor, granularity: int) -> bool:
    """True when, in every MoE layer and for every token of ``input_ids [B, S]``, the router
    picks whole copies: for each copy c, either all G slices ``c·G .. c·G+G-1`` or none.

    This is the condition under which a granular (G > 1) upcycle preserves the output; it
    always holds for G = 1.
    """
    if not _is_int(granularity) or granularity < 1:
        raise InvalidValueError(f"granularity: must be an int >= 1, got {granularity!r}")
    out = moe(input_ids)
    for rec in out.records:
        if rec is None:
            continue
        E = rec.num_experts
        if E % granularity:
            raise InvalidValueError(f"granularity: {granularity} does not divide the {E} experts")
        T = rec.probs.shape[0]
        sel = torch.zeros(T, E, dtype=torch.bool)
        sel[rec.token_idx.cpu(), rec.expert_idx.cpu()] = True
        sel = sel.view(T, E // granularity, granularity)
        if not bool((sel.all(-1) | ~sel.any(-1)).all()):
            return False
    return True
