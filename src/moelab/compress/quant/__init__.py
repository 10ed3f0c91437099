"""Post-training quantization of MoE experts: RTN, GPTQ and GPTVQ with per-expert Hessians, and
low-rank compensation (per expert, 1-D shared, TileQ 2-D grid as the authors' code does it, and
moelab's TileQ variant with cores)."""

from moelab.compress.quant.gptq import calibration_error, gptq_quantize
from moelab.compress.quant.gptvq import VQTensor, codebook_rows, gptvq_quantize
from moelab.compress.quant.hessian import HessianAccumulator
from moelab.compress.quant.lowrank import (
    activation_scale,
    activation_whitening,
    awq_scale,
    fit_lowrank,
    fit_per_expert,
    fit_per_expert_scaled,
    fit_shared_1d,
    fit_tileq,
    fit_tileq_core,
    lowrank_extra_params,
    tileq_code_lora_params,
    tileq_placement,
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
    "VQTensor",
    "activation_scale",
    "activation_whitening",
    "awq_scale",
    "calibration_error",
    "codebook_rows",
    "collect_hessians",
    "fit_lowrank",
    "fit_per_expert",
    "fit_per_expert_scaled",
    "fit_shared_1d",
    "fit_tileq",
    "fit_tileq_core",
    "gptq_quantize",
    "gptvq_quantize",
    "lowrank_extra_params",
    "output_error",
    "quantize_layer",
    "quantize_model",
    "quantize_rtn",
    "tileq_code_lora_params",
    "tileq_placement",
]
