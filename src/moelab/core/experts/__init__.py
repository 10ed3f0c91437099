"""Expert banks and the grouped matmul they run on."""

from moelab.core.experts.bank import ExpertBank, SharedExpert
from moelab.core.experts.grouped_mm import grouped_mm
from moelab.core.experts.quantized import QuantizedExpertBank, QuantSpec

__all__ = ["ExpertBank", "QuantSpec", "QuantizedExpertBank", "SharedExpert", "grouped_mm"]
