"""Low-rank overhead as a share of MoE-layer latency — TileQ's speed metric (arXiv 2605.09281,
abstract: the low-rank path adds about 5 % to the MoE layer [S]).

One quantized MoE layer's whole forward (router, dispatch, dequantized expert GEMMs, combine)
is timed with its low-rank corrections and without them (the same layer with the factors
removed), interleaved round-robin with the median of the repeats (``_timing``), on the
layer's real inputs: a prefill batch (every captured token) and a decode step (one token of
each of ``decode_rows`` sequences). Reported: both times and ``overhead = (t_with −
t_without) / t_without`` (the extra latency relative to the plain quantized layer, the
paper's "overhead") — each scheme on its own path (:mod:`moelab.core.experts.lowrank`).

``benchmarks/quantize.py`` calls :func:`lowrank_overhead` for every low-rank setting; run
alone, the script is a smoke test on a tiny random model (half a minute)::

    python benchmarks/quant_overhead.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved_medians
from moelab.compress.calibration import route
from moelab.core.layer import MoELayer
from moelab.models.hooks import moe_layers


def without_lowrank(layer: MoELayer) -> MoELayer:
    """A copy of the quantized ``layer`` whose projections carry no low-rank correction."""
    plain = copy.deepcopy(layer)
    for p in plain.experts.projections.values():
        p.lowrank = None
    return plain


def layer_inputs(model, batches: list[Tensor], index: int = 0) -> Tensor:
    """``[B, S, D]`` inputs of MoE layer ``index`` for the ``batches`` (concatenated)."""
    got = []

    def grab(i, layer, x, out):
        if i == index:
            got.append(x.detach())

    route(model, batches, grab, upto_layer=index)
    return torch.cat(got)


def lowrank_overhead(
    layer: MoELayer, x: Tensor, decode_rows: int = 8, repeats: int = 9, budget_s: float = 3.0
) -> dict[str, float]:
    """Times (seconds) of ``layer`` with and without its low-rank path and the overhead.

    Args:
        layer: a MoE layer whose experts are a quantized bank with low-rank factors.
        x: ``[B, S, D]`` its inputs (prefill: all of them; decode: the last position of the
            first ``decode_rows`` sequences, or fewer).
    Returns:
        ``{"prefill_with", "prefill_without", "prefill_overhead", "decode_with", ...}``;
        overheads as fractions.
    """
    plain = without_lowrank(layer)
    out = {}
    for phase, inp in (("prefill", x), ("decode", x[:decode_rows, -1:])):
        with torch.no_grad():
            t = interleaved_medians(
                {"with": lambda inp=inp: layer(inp), "without": lambda inp=inp: plain(inp)},
                repeats=repeats,
                budget_s=budget_s,
            )
        out[f"{phase}_with"], out[f"{phase}_without"] = t["with"], t["without"]
        out[f"{phase}_overhead"] = (t["with"] - t["without"]) / t["without"]
    return out


def quick() -> None:
    """Smoke run: a one-layer random model (8 experts, top-2, d = 64), 2-bit RTN, rank 4."""
    from moelab.compress.quant import QuantizeConfig, quantize_model
    from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
    from moelab.core.experts.quantized import QuantSpec
    from moelab.models import ModelConfig, MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64, d_model=64, n_layers=1, n_heads=2, max_seq_len=64,
        moe=MoEConfig(router=RouterConfig(num_experts=8, top_k=2),
                      experts=ExpertsConfig(hidden_size=64, ffn_hidden_size=32)),
    )  # fmt: skip
    fp = MoETransformer(cfg).eval()
    batches = [torch.randint(0, 64, (4, 32)) for _ in range(2)]
    grids = {"per-expert": None, "shared-1d": None, "tileq": (4, 2), "tileq-core": (2, 4)}
    for scheme, grid in grids.items():
        m = copy.deepcopy(fp)
        spec = QuantSpec(method="rtn", bits=2, group_size=32, symmetric=False, act_order=False,
                         lowrank=scheme, rank=4, grid=grid)  # fmt: skip
        quantize_model(m, batches, QuantizeConfig(spec=spec, min_tokens=2))
        o = lowrank_overhead(moe_layers(m)[0], layer_inputs(m, batches), repeats=5, budget_s=0.5)
        print(f"{scheme:10s} prefill {1e3 * o['prefill_without']:.2f} ms -> "
              f"{1e3 * o['prefill_with']:.2f} ms ({100 * o['prefill_overhead']:+.1f} %); decode "
              f"{1e3 * o['decode_without']:.3f} ms -> {1e3 * o['decode_with']:.3f} ms "
              f"({100 * o['decode_overhead']:+.1f} %)")  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    quick()
