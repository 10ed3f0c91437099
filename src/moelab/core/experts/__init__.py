"""Expert banks and the grouped matmul they run on."""

from moelab.core.experts.bank import ExpertBank, SharedExpert
from moelab.core.experts.grouped_mm import grouped_mm

__all__ = ["ExpertBank", "SharedExpert", "grouped_mm"]
