"""Hugging Face interop: import/export Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE checkpoints and
DeepSeek-V3 MoE blocks (see :mod:`moelab.interop.hf`), BERT encoder folders
(:mod:`moelab.interop.bert`); GGUF export for llama.cpp (:mod:`moelab.interop.gguf_export`)
and GGUF reading (:mod:`moelab.interop.gguf`)."""

from moelab.interop.bert import load_bert, save_bert
from moelab.interop.deepseek_v3 import (
    deepseek_v3_config_fields,
    export_deepseek_v3_moe,
    import_deepseek_v3_moe,
    moe_config_from_deepseek_v3,
)
from moelab.interop.errors import (
    ConfigMismatchError,
    InteropError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedConfigError,
)
from moelab.interop.gguf_export import GGUFExportReport, export_gguf
from moelab.interop.gguf_layout import GGUF_ARCHS
from moelab.interop.hf import (
    HF_SOURCE_FILE,
    ConvertReport,
    HFMeta,
    convert,
    export_hf,
    hf_state,
    import_hf,
    model_from_hf_state,
)
from moelab.interop.hf_config import ARCHS, config_from_hf, config_to_hf, infer_arch
from moelab.interop.hf_weights import LAYOUTS, detect_layout

__all__ = [
    "ARCHS",
    "GGUF_ARCHS",
    "HF_SOURCE_FILE",
    "LAYOUTS",
    "ConfigMismatchError",
    "ConvertReport",
    "GGUFExportReport",
    "HFMeta",
    "InteropError",
    "MissingTensorError",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedConfigError",
    "config_from_hf",
    "config_to_hf",
    "convert",
    "deepseek_v3_config_fields",
    "detect_layout",
    "export_deepseek_v3_moe",
    "export_gguf",
    "export_hf",
    "hf_state",
    "import_deepseek_v3_moe",
    "import_hf",
    "infer_arch",
    "load_bert",
    "model_from_hf_state",
    "moe_config_from_deepseek_v3",
    "save_bert",
]
