"""Adapters injectable into any model by module name: LoRA, a mixture of LoRA experts that
can grow, the bilinear MoE-LoRA of MoELoRA and SAME, and bottleneck (parallel) adapters; plus
name-based freezing."""

from moelab.models.adapters.bilinear_lora import BilinearMoELoRALinear
from moelab.models.adapters.freeze import freeze_except
from moelab.models.adapters.inject import (
    ADAPTER_TYPES,
    add_lora,
    add_moe_lora,
    add_parallel_adapters,
    inject_adapters,
    merge_adapters,
    select_modules,
)
from moelab.models.adapters.lora import LoRALinear
from moelab.models.adapters.moe_lora import MoELoRALinear
from moelab.models.adapters.moram import MoRAMLinear
from moelab.models.adapters.parallel import ParallelAdapter, ParallelAdapterWrapper

__all__ = [
    "ADAPTER_TYPES",
    "BilinearMoELoRALinear",
    "LoRALinear",
    "MoELoRALinear",
    "MoRAMLinear",
    "ParallelAdapter",
    "ParallelAdapterWrapper",
    "add_lora",
    "add_moe_lora",
    "add_parallel_adapters",
    "freeze_except",
    "inject_adapters",
    "merge_adapters",
    "select_modules",
]
