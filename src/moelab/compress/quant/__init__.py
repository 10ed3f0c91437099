"""Post-training quantization of MoE experts: RTN, GPTQ with per-expert Hessians, and
low-rank compensation of the quantization error (per expert, 1-D shared, TileQ 2-D grid)."""

from moelab.compress.quant.gptq import calibration_error, gptq_quantize
from moelab.compress.quant.hessian import HessianAccumulator
from moelab.compress.quant.lowrank import (
    activation_scale,
    activation_whitening,
    fit_lowrank,
    fit_per_expert,
    fit_shared_1d,
    fit_tileq,
    lowrank_extra_params,
)
from moelab.compress.quant.pipeline import (
    LayerHessians,
    LayerReport,
    QuantizeConfig,
    QuantizeReport,
    collect_hessians,
    output_error,
    quantize_layer,
    quantize_model,
)
from moelab.compress.quant.rtn import QuantizedTensor, quantize_rtn

__all__ = [
    "HessianAccumulator",
    "LayerHessians",
    "LayerReport",
    "QuantizeConfig",
    "QuantizeReport",
    "QuantizedTensor",
    "activation_scale",
    "activation_whitening",
    "calibration_error",
    "collect_hessians",
    "fit_lowrank",
    "fit_per_expert",
    "fit_shared_1d",
    "fit_tileq",
    "gptq_quantize",
    "lowrank_extra_params",
    "output_error",
    "quantize_layer",
    "quantize_model",
    "quantize_rtn",
]
