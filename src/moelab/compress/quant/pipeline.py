"""Quantize every MoE expert bank of a model: calibration Hessians, RTN/GPTQ, low-rank
compensation, and a per-layer report with exact bits per parameter.

Per MoE layer (in depth order) and projection (gate, up, down — or up, down for GELU):

1. route the calibration batches through the model (:func:`moelab.compress.calibration.route`)
   and stream each expert's Hessian from the rows it was routed (gate/up: the layer input
   rows; down: the expert's own intermediate activations ``silu(x W_g) ⊙ x W_u``), with exact
   per-expert counts (:class:`~moelab.compress.quant.hessian.HessianAccumulator`);
2. quantize all experts of the projection at once (:func:`gptq_quantize`,
   :func:`quantize_rtn` or :func:`~moelab.compress.quant.gptvq.gptvq_quantize`);
3. experts that calibration routed fewer than ``min_tokens`` rows to are *under-calibrated*:
   they get the weight-derived RTN codes and scales instead of GPTQ's (a Hessian from a
   handful of rows over-fits them) — with GPTVQ, codebooks fitted to the weights alone
   (an identity Hessian) — and are listed in the report;
4. fit the low-rank compensation (:mod:`moelab.compress.quant.lowrank`): by default of
   ``W − Q(W)`` weighted by the layer-pooled activation weighting; for ``lowrank="tileq"``
   as the authors' code does it — ``L = fit(W)`` with per-expert AWQ scales, fitted once
   and kept, the residual ``W − L`` quantized, ``Q(W − L) + L`` stored (``target =
   "weight-once"``, ``weighting = "awq"``);
5. swap the layer's bank for a :class:`~moelab.core.experts.quantized.QuantizedExpertBank`.

``sequential=True`` (GPTQ's own recipe) calibrates layer ``l`` on the outputs of the already
quantized layers ``< l`` (one routing pass per layer, each stopped after the layer it
needs); ``sequential=False`` collects every layer's Hessians in one pass of the
full-precision model (cheaper: what the benchmark uses to share one pass across settings).

Choices of this project [I]: ``min_tokens`` default 16; the low-rank weighting is the
pooled ``sqrt(diag H)`` (see :mod:`~moelab.compress.quant.lowrank`); the reported errors are
relative output errors on the calibration rows, each expert with its own inputs
(:func:`output_error`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from moelab.compress.calibration import route, routed_pairs
from moelab.compress.quant.gptq import GROUP_STATS, gptq_quantize
from moelab.compress.quant.gptvq import VQTensor, gptvq_quantize
from moelab.compress.quant.hessian import HessianAccumulator
from moelab.compress.quant.lowrank import (
    activation_scale,
    activation_whitening,
    awq_scale,
    fit_lowrank,
)
from moelab.compress.quant.rotation import rotation_permutation
from moelab.compress.quant.rtn import QuantizedTensor, quantize_rtn
from moelab.core.config import GATED_ACTIVATIONS
from moelab.core.experts.bank import ExpertBank
from moelab.core.experts.quantized import (
    QuantizedExpertBank,
    QuantizedProjection,
    QuantSpec,
    as_stored,
)
from moelab.core.experts.rotation import rotate, rotate_hessian, unrotate
from moelab.core.layer import MoELayer, MoEOutput
from moelab.errors import InvalidValueError
from moelab.models.hooks import moe_layers


@dataclass(frozen=True)
class QuantizeConfig:
    """Settings of :func:`quantize_model` beyond the stored :class:`QuantSpec`.

    Attributes:
        spec: bits, group size, symmetry, act-order, low-rank scheme/rank/grid.
        damp: GPTQ dampening (fraction of mean diag H), in (0, 1].
        block_size: GPTQ lazy-batch width.
        group_stats: where GPTQ reads a group's scale: ``"reference"`` (the reference code's
            rule, default) or ``"updated"`` (:func:`~moelab.compress.quant.gptq.gptq_quantize`).
        min_tokens: experts routed fewer calibration rows fall back to RTN (>= 0).
        sweeps: TileQ HOOI refinement sweeps (>= 0).
        seed: grid-assignment restarts' seed.
        kmeans_iters: GPTVQ's k-means iterations per codebook (the authors run 100; >= 0).
        sequential: calibrate each layer on the quantized layers before it.
        target: what the low-rank factors are fitted to: ``"error"`` (quantize, then
            compensate ``W − Q(W)``; the research notes' option A), ``"weight"`` (option B:
            fit ``L₀`` to ``W``, quantize the residual ``W − L₀``, then refit the factors to
            ``W − Q(W − L₀)``; moelab's) or ``"weight-once"`` (the authors' code [K]: fit
            ``L`` to ``W`` once, quantize ``W − L``, store ``Q(W − L) + L``; LoPRo
            ``res = W − lora``, ``QR = Q + lora``). None (default): ``"weight-once"`` for
            ``lowrank="tileq"``, ``"error"`` otherwise.
        weighting: the low-rank fit's activation weighting: ``"full"`` (``S = (H +
            λI)^{1/2}`` with the layer-pooled H and λ = ``damp``·mean diag, so the fit minimises
            the pooled output error itself), ``"diag"`` (``D = diag(sqrt(diag H))``, the
            research notes' step 1) or ``"awq"`` (the code's per-expert ``s_e`` from each
            expert's own rows, :func:`~moelab.compress.quant.lowrank.awq_scale` [K];
            per-expert and tileq only). None (default): ``"awq"`` for tileq, ``"full"``
            otherwise. [I] full rather than diag for the others: on the main run at 2 bits
            (RTN) it tripled the per-expert compensation's bits-per-byte gain over diag.
    Raises:
        ValueError: a field out of range (act-order needs GPTQ).
    """

    spec: QuantSpec = field(default_factory=QuantSpec)
    damp: float = 0.01
    block_size: int = 128
    group_stats: str = "reference"
    min_tokens: int = 16
    sweeps: int = 2
    seed: int = 0
    kmeans_iters: int = 100
    sequential: bool = True
    target: str | None = None
    weighting: str | None = None

    def __post_init__(self) -> None:
        if self.weighting not in (None, "diag", "full", "awq"):
            raise InvalidValueError(
                f"weighting: must be 'diag', 'full' or 'awq', got {self.weighting!r}"
            )
        if self.target not in (None, "error", "weight", "weight-once"):
            raise InvalidValueError(
                f"target: must be 'error', 'weight' or 'weight-once', got {self.target!r}"
            )
        if self.group_stats not in GROUP_STATS:
            raise InvalidValueError(
                f"group_stats: must be {' or '.join(GROUP_STATS)}, got {self.group_stats!r}"
            )
        lr = self.spec.lowrank
        if lr == "tileq" and self.lowrank_weighting == "full":
            raise InvalidValueError("weighting: tileq needs a diagonal scale ('awq' or 'diag')")
        if self.lowrank_weighting == "awq" and lr not in ("none", "per-expert", "tileq"):
            raise InvalidValueError(
                f"weighting: 'awq' (per-expert input scales) needs per-expert or tileq, not {lr!r}"
            )
        if not 0 < self.damp <= 1:
            raise InvalidValueError(f"damp: must be in (0, 1], got {self.damp}")
        if self.block_size < 1:
            raise InvalidValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.min_tokens < 0:
            raise InvalidValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.sweeps < 0:
            raise InvalidValueError(f"sweeps: must be >= 0, got {self.sweeps}")
        if self.kmeans_iters < 0:
            raise InvalidValueError(f"kmeans_iters: must be >= 0, got {self.kmeans_iters}")
        if self.spec.act_order and self.spec.method != "gptq":
            raise InvalidValueError("act_order: only GPTQ orders columns (method='gptq')")

    @property
    def lowrank_target(self) -> str:
        """The target in effect (the default resolved for the scheme)."""
        if self.target is not None:
            return self.target
        return "weight-once" if self.spec.lowrank == "tileq" else "error"

    @property
    def lowrank_weighting(self) -> str:
        """The weighting in effect (the default resolved for the scheme)."""
        if self.weighting is not None:
            return self.weighting
        return "awq" if self.spec.lowrank == "tileq" else "full"


@dataclass
class LayerReport:
    """One MoE layer's outcome.

    Attributes:
        layer: index among the MoE layers.
        tokens: ``[E]`` calibration rows routed to each expert.
        under_calibrated: experts with fewer than ``min_tokens`` rows (RTN fallback).
        quant_error: per projection, :func:`output_error` of the quantized part against what
            it quantized (``W``, or the residual ``W − L`` with the weight targets).
        lowrank_error: per projection, the error of ``Q + L`` against ``W``.
        bytes: stored bytes per component (codes, scales, zeros, g_idx, lowrank).
        weights: expert weight entries represented.
    """

    layer: int
    tokens: list[int]
    under_calibrated: list[int]
    quant_error: dict[str, float]
    lowrank_error: dict[str, float]
    bytes: dict[str, int]
    weights: int

    @property
    def bits_per_param(self) -> float:
        return 8 * sum(self.bytes.values()) / self.weights


@dataclass
class QuantizeReport:
    """What :func:`quantize_model` did; :meth:`to_dict` is the folder's ``quantize.json``."""

    spec: QuantSpec
    layers: list[LayerReport]
    calib_tokens: int

    @property
    def expert_weights(self) -> int:
        return sum(r.weights for r in self.layers)

    def total_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.layers:
            for k, v in r.bytes.items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def bits_per_param(self) -> float:
        """Bits per expert weight, all stored components (codes, scales, zeros, g_idx and
        low-rank factors) included."""
        return 8 * sum(self.total_bytes().values()) / max(self.expert_weights, 1)

    @property
    def lowrank_bytes(self) -> int:
        return self.total_bytes().get("lowrank", 0)

    @property
    def under_calibrated(self) -> dict[int, list[int]]:
        return {r.layer: r.under_calibrated for r in self.layers if r.under_calibrated}

    def to_dict(self) -> dict:
        return {
            "spec": self.spec.to_dict(),
            "calib_tokens": self.calib_tokens,
            "bits_per_param": self.bits_per_param,
            "bytes": self.total_bytes(),
            "expert_weights": self.expert_weights,
            "under_calibrated": {str(k): v for k, v in self.under_calibrated.items()},
            "layers": [{**asdict(r), "bits_per_param": r.bits_per_param} for r in self.layers],
        }


class LayerHessians:
    """Hessians of one layer's projections: input rows (gate/up share them) and the down
    projection's intermediate rows."""

    def __init__(self, layer: MoELayer) -> None:
        ex = layer.config.experts
        E = layer.config.router.num_experts
        self.inputs = HessianAccumulator(E, ex.hidden_size)
        self.inter = HessianAccumulator(E, ex.ffn_hidden_size)

    def observe(self, layer: MoELayer, x: Tensor, out: MoEOutput) -> None:
        pairs = routed_pairs(layer, x, out.plan)
        bank = layer.experts
        xs = pairs.x.to(bank.w_down.dtype)
        _, a = bank(xs, pairs.counts, return_activations=True)
        self.inputs.add(xs, pairs.counts)
        self.inter.add(a, pairs.counts)


def _projection_weights(bank: ExpertBank) -> dict[str, Tensor]:
    """``{name: W [E, O, I]}`` float32 from a full-precision bank."""
    Fh = bank.config.ffn_hidden_size
    w_in = bank.w_in.detach().float()
    out = {}
    if bank.config.activation in GATED_ACTIVATIONS:
        out["gate"] = w_in[:, :, :Fh].transpose(1, 2)
        out["up"] = w_in[:, :, Fh:].transpose(1, 2)
    else:
        out["up"] = w_in.transpose(1, 2)
    out["down"] = bank.w_down.detach().float().transpose(1, 2)
    return {k: v.contiguous() for k, v in out.items()}


def output_error(W: Tensor, W_hat: Tensor, sums: Tensor) -> float:
    """Relative calibration output error ``sqrt(Σ_e tr(ΔW_e S_e ΔW_eᵀ) / Σ_e tr(W_e S_e W_eᵀ))``
    over every routed row, with each expert's own ``S_e = Σ x xᵀ`` ``[E, I, I]`` (``ΔW = W − Ŵ``,
    ``W [E, O, I]``): ``‖ΔY‖_F / ‖Y‖_F`` of the projection's outputs on the calibration rows."""
    S = sums.double()
    dW = (W - W_hat).double()
    num = torch.einsum("eoi,eij,eoj->", dW, S, dW)
    den = torch.einsum("eoi,eij,eoj->", W.double(), S, W.double())
    return float(torch.sqrt(num / den)) if float(den) > 0 else 0.0


def _quantize_projection(
    W: Tensor, acc: HessianAccumulator, cfg: QuantizeConfig, under: Tensor
) -> tuple[QuantizedTensor | VQTensor, Tensor | None]:
    """Codes of ``W [E, O, I]`` and, with ``spec.rotate_block``, the rotation's column order
    ``perm [E, I]`` (then the codes quantize ``W R_e`` with the Hessians ``R_eᵀ H R_e``)."""
    spec = cfg.spec
    H = acc.hessians()
    perm = None
    if spec.rotate_block:
        perm = rotation_permutation(W, H)
        W = rotate(W, perm, spec.rotate_block)
        H = rotate_hessian(H, perm, spec.rotate_block)
    if spec.vector:
        if under.any():  # weight-derived codebooks for experts calibration barely reached
            H = H.clone()
            H[under] = torch.eye(W.shape[2], dtype=H.dtype)
        vq = gptvq_quantize(
            W, H.float(), spec.bits, spec.vq_dim, spec.group_size, spec.vq_rows,
            damp=cfg.damp, block_size=cfg.block_size, kmeans_iters=cfg.kmeans_iters,
        )  # fmt: skip
        return vq, perm
    rtn = quantize_rtn(W, spec.bits, spec.group_size, spec.symmetric)
    if spec.method == "rtn":
        return rtn, perm
    q = gptq_quantize(
        W, H.float(), spec.bits, spec.group_size, symmetric=spec.symmetric,
        damp=cfg.damp, act_order=spec.act_order, block_size=cfg.block_size,
        group_stats=cfg.group_stats,
    )  # fmt: skip
    if under.any():  # weight-derived fallback for experts calibration barely reached
        q.codes[under] = rtn.codes[under]
        q.scales[under] = rtn.scales[under]
        if q.zeros is not None:
            q.zeros[under] = rtn.zeros[under]
        if q.g_idx is not None:
            q.g_idx[under] = torch.arange(W.shape[2]) // spec.group_size
    return q, perm


def quantize_layer(
    layer: MoELayer, hess: LayerHessians, cfg: QuantizeConfig, index: int
) -> LayerReport:
    """Quantize one layer's bank from its collected Hessians and swap it in (in place)."""
    bank = layer.experts
    if not isinstance(bank, ExpertBank):
        raise InvalidValueError(f"model: MoE layer {index} is already quantized")
    spec = cfg.spec
    E = layer.config.router.num_experts
    counts = hess.inputs.counts
    under = counts < cfg.min_tokens
    weights = _projection_weights(bank)
    projections: dict[str, QuantizedProjection] = {}
    q_err: dict[str, float] = {}
    lr_err: dict[str, float] = {}
    target, weighting = cfg.lowrank_target, cfg.lowrank_weighting
    for name, W in weights.items():
        acc = hess.inter if name == "down" else hess.inputs
        if weighting == "awq":
            d = awq_scale(acc.mean_abs(), acc.counts)  # [E, I], each expert its own rows
        elif weighting == "diag":
            d = activation_scale(acc.pooled())
        else:
            d = activation_whitening(acc.pooled(), cfg.damp)

        def fit(target: Tensor, d: Tensor = d, name: str = name):
            f = fit_lowrank(
                spec.lowrank, target, d, spec.rank, spec.grid, sweeps=cfg.sweeps, seed=cfg.seed,
                per_expert_scale=weighting == "awq",
            )  # fmt: skip
            for t in ("U", "V", "S", "in_scale"):  # round as stored (float16) before use
                if getattr(f, t) is not None:
                    what = f"MoE layer {index} {name} projection: low-rank factor {t}"
                    setattr(f, t, as_stored(getattr(f, t), what).float())
            return f

        base, factors = W, None
        if spec.lowrank != "none" and target == "weight":
            base = W - fit(W).dense()
        elif spec.lowrank != "none" and target == "weight-once":
            factors = fit(W)  # kept: no refit to the quantization error [K]
            base = W - factors.dense()
        q, perm = _quantize_projection(base, acc, cfg, under)
        What = q.dequantize()
        if perm is not None:
            What = unrotate(What, perm, spec.rotate_block)
        q_err[name] = output_error(base, What, acc.sums)
        if spec.lowrank != "none" and factors is None:
            factors = fit(W - What)
        proj = QuantizedProjection.from_codes(
            spec, q.codes, q.scales, q.zeros, q.g_idx, factors, perm=perm, codebook=q.codebook
        )
        if factors is not None:
            lr_err[name] = output_error(W, What + proj.lowrank.dense(), acc.sums)
        projections[name] = proj
    biases = (bank.b_in, bank.b_down) if bank.config.bias else None
    qbank = QuantizedExpertBank.from_projections(bank.config, E, spec, projections, biases)
    layer.experts = qbank.to(device=bank.w_down.device, dtype=bank.w_down.dtype)
    return LayerReport(
        layer=index,
        tokens=counts.tolist(),
        under_calibrated=under.nonzero().flatten().tolist(),
        quant_error=q_err,
        lowrank_error=lr_err,
        bytes=qbank.storage_bytes(),
        weights=qbank.num_weights(),
    )


def collect_hessians(
    model: torch.nn.Module,
    batches: Iterable[Tensor],
    *,
    on_batch: Callable[[int], None] | None = None,
) -> list[LayerHessians]:
    """Every MoE layer's Hessians from one pass of ``model`` (as it is: no layer is
    quantized in between). Reusable across :func:`quantize_layer` calls with different
    settings on copies of the same model.

    Raises:
        ValueError: the model has no MoE layer.
    """
    layers = moe_layers(model)
    if not layers:
        raise InvalidValueError("model: has no MoE layer to quantize")
    hess = [LayerHessians(layer) for layer in layers]
    route(model, batches, lambda j, lay, x, out: hess[j].observe(lay, x, out), on_batch=on_batch)
    return hess


def quantize_model(
    model: torch.nn.Module,
    batches: Iterable[Tensor],
    cfg: QuantizeConfig,
    *,
    on_batch: Callable[[int], None] | None = None,
    on_layer: Callable[[LayerReport], None] | None = None,
    on_pass: Callable[[str], None] | None = None,
) -> QuantizeReport:
    """Quantize every MoE expert bank of ``model`` in place.

    Args:
        model: a full-precision :class:`~moelab.models.MoETransformer`.
        batches: re-iterable ``[B, S]`` calibration ids (e.g. a ``CalibrationSet``).
        cfg: settings.
        on_batch: called with each batch's token count (progress).
        on_layer: called with each finished layer's report.
        on_pass: called with a label before each calibration pass (progress bars).
    Raises:
        ValueError: the model has no MoE layer, is already quantized, the spec does not fit
            it (group size, rank, grid), calibration gives no tokens, a scale or low-rank
            factor does not fit float16, or the quantized model's outputs are not finite
            (:func:`check_finite_outputs`).
    """
    layers = moe_layers(model)
    if not layers:
        raise InvalidValueError("model: has no MoE layer to quantize")
    for i, layer in enumerate(layers):
        if isinstance(layer.experts, QuantizedExpertBank):
            raise InvalidValueError(f"model: MoE layer {i} is already quantized")
        ex = layer.config.experts
        if ex.lora_rank:
            raise InvalidValueError(
                "model: the experts carry LoRA adapters; merge them first (moelab merge-lora)"
            )
        cfg.spec.check_model(layer.config.router.num_experts, (ex.hidden_size, ex.ffn_hidden_size))
    batches = list(batches)
    tokens = sum(b.numel() for b in batches)
    if tokens == 0:
        raise InvalidValueError("calibration: no tokens")
    reports: list[LayerReport] = []
    if cfg.sequential:
        for i, layer in enumerate(layers):
            hess = LayerHessians(layer)

            def observe(j: int, lay: MoELayer, x: Tensor, out: MoEOutput, i=i, hess=hess) -> None:
                if j == i:
                    hess.observe(lay, x, out)

            if on_pass is not None:
                on_pass(f"calibrating MoE layer {i + 1}/{len(layers)}")
            route(model, batches, observe, upto_layer=i, on_batch=on_batch)
            reports.append(quantize_layer(layer, hess, cfg, i))
            if on_layer is not None:
                on_layer(reports[-1])
    else:
        if on_pass is not None:
            on_pass("calibrating all MoE layers")
        all_hess = collect_hessians(model, batches, on_batch=on_batch)
        for i, layer in enumerate(layers):
            reports.append(quantize_layer(layer, all_hess[i], cfg, i))
            if on_layer is not None:
                on_layer(reports[-1])
    check_finite_outputs(model, batches[0])
    return QuantizeReport(spec=cfg.spec, layers=reports, calib_tokens=tokens)


@torch.no_grad()
def check_finite_outputs(model: torch.nn.Module, ids: Tensor) -> None:
    """Run ``ids [B, S]`` through the quantized ``model`` and raise ValueError naming the
    first MoE layer whose output is not finite (or the logits, when only they are): a
    quantized model that outputs NaN must never be written."""
    bad: list[int] = []
    hooks = [
        layer.register_forward_hook(
            lambda m, a, out, i=i: (
                bad.append(i) if not bad and not torch.isfinite(out.hidden_states).all() else None
            )
        )
        for i, layer in enumerate(moe_layers(model))
    ]
    try:
        finite = bool(torch.isfinite(model(ids).logits).all())
    finally:
        for h in hooks:
            h.remove()
    if bad or not finite:
        where = f"MoE layer {bad[0]}'s outputs" if bad else "the logits"
        raise InvalidValueError(
            f"quantize: {where} are not finite on the calibration text after quantization; "
            "the quantized model is unusable and must not be saved"
        )
