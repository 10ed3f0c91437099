"""Expert banks and the grouped matmul they run on."""

from moelab.core.experts.bank import ExpertBank, SharedExpert
from moelab.core.experts.grouped_mm import grouped_mm
from moelab.core.experts.quantized import QuantizedExpertBank, QuantSpec
from moelab.core.experts.residual import ResidualMLPExpertBank

__all__ = [
    "ExpertBank",
    "QuantSpec",
    "QuantizedExpertBank",
    "ResidualMLPExpertBank",
    "SharedExpert",
    "grouped_mm",
]
