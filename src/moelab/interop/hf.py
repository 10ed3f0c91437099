"""Import and export whole Hugging Face MoE causal LMs: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

``import_hf(folder) -> (MoETransformer, HFMeta)`` reads ``config.json`` and the safetensors
weights (fused v5 or per-expert v4 layout, detected from the tensor names), maps the config
(:mod:`moelab.interop.hf_config`) and every tensor (:mod:`moelab.interop.hf_weights`) strictly:
a missing, unexpected or mis-shaped tensor, or a config the weights contradict, raises an
:class:`~moelab.interop.errors.InteropError` subclass naming it. ``export_hf`` writes a folder
that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, atomically (temp folder +
rename). Architecture facts: see the docstrings of ``hf_config`` and ``hf_weights`` (read from
transformers 5.24 ``models/{mixtral,qwen2_moe,qwen3_moe,olmoe}/modeling_*.py``,
``configuration_*.py`` and ``conversion_mapping.py``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from torch import Tensor

from moelab.errors import InvalidValueError
from moelab.interop.errors import ConfigMismatchError, InteropError, UnsupportedConfigError
from moelab.interop.files import (
    copy_tokenizer,
    read_json,
    read_tensors,
)
from moelab.interop.hf_config import ARCHS, config_from_hf, config_to_hf, infer_arch
from moelab.interop.hf_weights import (
    LAYOUTS,
    apply_export,
    apply_import,
    check_counts,
    detect_layout,
    model_rules,
)
from moelab.models import MoETransformer, load_model, save_model
from moelab.models.memory import check_model_fits
from moelab.models.quantized import is_quantized
from moelab.utils.atomic import write_folder_atomically
from moelab.utils.outdir import MARKER, check_output_folder

HF_SOURCE_FILE = "hf_source.json"
"""Written next to a converted moelab model: the original HF config, arch and layout, so an
export can restore the fields moelab does not model (token ids, …)."""

Layout = Literal["per_expert", "fused"]


@dataclass
class HFMeta:
    """What :func:`import_hf` learned besides the model.

    Attributes:
        arch: HF ``model_type`` (``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"``, ``"olmoe"``).
        layout: ``"per_expert"`` or ``"fused"`` expert tensors.
        hf_config: the config.json dict.
        source: the folder read (None for in-memory imports).
        tokenizer_files: tokenizer files present in the source folder.
        notes: human-readable remarks (e.g. no tokenizer; aux-loss convention).
    """

    arch: str
    layout: str
    hf_config: dict[str, Any]
    source: Path | None = None
    tokenizer_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def model_from_hf_state(
    hf_config: dict[str, Any], tensors: dict[str, Tensor], where: str = "checkpoint"
) -> tuple[MoETransformer, HFMeta]:
    """Build a moelab model from an HF config dict and its tensors (in memory).

    The model takes the dtype of ``model.embed_tokens.weight``; values are copied bit for bit.

    Raises:
        InteropError: one of its subclasses (UnsupportedConfigError, ConfigMismatchError,
            MissingTensorError, UnexpectedTensorError, TensorShapeError), naming the field or
            tensor.
    """
    cfg, spec = config_from_hf(hf_config)
    emb = tensors.get("model.embed_tokens.weight")
    check_model_fits(cfg, emb.element_size() if emb is not None else 4)  # before any allocation
    layout = detect_layout(tensors)
    check_counts(
        tensors, cfg.n_layers, (spec.num_experts_field, cfg.moe.router.num_experts), layout
    )
    tensors = dict(tensors)
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("model.embed_tokens.weight")
        if emb is not None and not torch.equal(head, emb):
            raise ConfigMismatchError(
                f"tie_word_embeddings: true in config.json, but {where} holds an lm_head.weight "
                "that differs from model.embed_tokens.weight"
            )
    state = apply_import(model_rules(cfg, spec.name, layout), tensors, where)
    model = MoETransformer(cfg)
    dtype = state["embed.weight"].dtype
    if dtype != model.embed.weight.dtype:
        model = model.to(dtype)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    if cfg.tie_embeddings and model.lm_head.weight is not model.embed.weight:
        raise InteropError("tied embeddings came apart while loading")  # pragma: no cover
    notes = []
    if cfg.moe is not None and cfg.moe.losses.aux_loss_coeff > 0:
        notes.append(
            "load-balancing loss: router_aux_loss_coef with transformers' convention "
            "(balanced = k), computed per layer rather than pooled over layers"
        )
    return model.eval(), HFMeta(spec.name, layout, dict(hf_config), notes=notes)


def import_hf(path: str | os.PathLike[str]) -> tuple[MoETransformer, HFMeta]:
    """Load a Hugging Face checkpoint folder (``config.json`` + safetensors) as a moelab model.

    Returns:
        ``(model, meta)``: the model in eval mode, in the checkpoint's dtype, on CPU.
    Raises:
        InteropError (a ``ValueError``) or a subclass, naming the file, field or tensor.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise InteropError(f"{folder}: not a folder")
    hf_config = read_json(folder / "config.json")
    if not isinstance(hf_config, dict):
        raise InteropError(f"{folder / 'config.json'}: expected a JSON object")
    tensors = read_tensors(folder)
    model, meta = model_from_hf_state(hf_config, tensors, where=str(folder))
    meta.source = folder
    meta.tokenizer_files = [
        n for n in ("tokenizer.json", "tokenizer_config.json") if (folder / n).is_file()
    ]
    if "tokenizer.json" not in meta.tokenizer_files:
        meta.notes.append(f"no tokenizer.json in {folder}; no tokenizer to copy")
    return model, meta


def hf_state(
    model: MoETransformer, arch: str | None = None, layout: Layout = "per_expert"
) -> tuple[dict[str, Any], dict[str, Tensor], str]:
    """The HF ``config.json`` dict, tensors and architecture of ``model`` (in memory).

    Raises:
        UnsupportedConfigError: the model uses a feature ``arch`` cannot express.
    """
    if not isinstance(model, MoETransformer):
        raise TypeError(f"model: expected MoETransformer, got {type(model).__name__}")
    if layout not in LAYOUTS:
        raise InvalidValueError(f"layout: must be one of {LAYOUTS}, got {layout!r}")
    if is_quantized(model):  # its codes have no place in the HF layouts
        raise UnsupportedConfigError(
            "model: quantized (moelab quantize) weights have no Hugging Face form; export the "
            "full-precision model"
        )
    arch = arch or infer_arch(model.cfg)
    hf = config_to_hf(model.cfg, arch)
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    if model.cfg.logit_scale != 1.0:  # HF has no logit scale: fold it into the final norm,
        # exact since logits = W·(γ ⊙ rmsnorm(x))·s = W·((s·γ) ⊙ rmsnorm(x))
        state["norm.weight"] = state["norm.weight"] * model.cfg.logit_scale
    tensors = apply_export(model_rules(model.cfg, arch, layout), state)
    hf["dtype"] = str(model.embed.weight.dtype).removeprefix("torch.")
    return hf, tensors, arch


def export_hf(
    model: MoETransformer,
    out_dir: str | os.PathLike[str],
    arch: str | None = None,
    *,
    layout: Layout = "per_expert",
    base_config: dict[str, Any] | None = None,
    tokenizer_from: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint folder.

    Args:
        arch: ``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"`` or ``"olmoe"``; None infers it
            from the config (qk_norm head → qwen3_moe, full → olmoe, q/k/v bias or shared
            expert → qwen2_moe, else mixtral).
        layout: ``"per_expert"`` (Hub / transformers v4 names, what ``save_pretrained``
            writes by default) or ``"fused"`` (transformers v5 3-D ``gate_up_proj``).
        base_config: fields to keep that moelab does not model (e.g. token ids); structural
            fields always come from the model.
        tokenizer_from: a folder whose tokenizer files are copied along.
        overwrite: replace an existing non-empty ``out_dir``.
    Returns:
        ``out_dir``. The folder appears complete or not at all (temp folder + rename).
    Raises:
        UnsupportedConfigError naming the moelab field ``arch`` cannot express;
        OutputFolderError (:func:`moelab.utils.outdir.check_output_folder`): ``out_dir`` is
        or surrounds ``tokenizer_from``, holds files moelab did not write, or (a
        ``FileExistsError`` too) is not empty and not ``overwrite``.
    """
    hf, tensors, arch = hf_state(model, arch, layout)
    if base_config:
        merged = config_to_hf(model.cfg, arch, base_config)
        merged["dtype"] = hf["dtype"]
        merged.pop("torch_dtype", None)
        hf = merged

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_from is not None:
            copy_tokenizer(Path(tokenizer_from), tmp)

    out = Path(out_dir)
    inputs = [tokenizer_from] if tokenizer_from is not None else []
    write_folder_atomically(out, fill, overwrite, inputs=inputs)
    return out


@dataclass
class ConvertReport:
    """What :func:`convert` did: destination, architecture, layout, the tokenizer (and
    generation-config) files copied along, notes."""

    dst: Path
    direction: str
    arch: str
    layout: str
    copied_files: list[str]
    notes: list[str]


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    direction: str,
    *,
    arch: str | None = None,
    layout: Layout = "per_expert",
    overwrite: bool = False,
) -> ConvertReport:
    """Convert a checkpoint folder.

    Args:
        direction: ``"moelab"`` (HF folder → moelab model folder, as
            :func:`moelab.models.save_model` writes, plus the tokenizer files and
            ``hf_source.json``) or ``"hf"`` (moelab folder → HF folder).
        arch: for ``"hf"``: target architecture (default: the one recorded in
            ``hf_source.json``, else inferred). Ignored for ``"moelab"`` (read from the
            config) except that, when given, it must match.
        layout: for ``"hf"``: expert layout written.
    Raises:
        ValueError for a bad ``direction``; InteropError subclasses; CheckpointError for
        an invalid moelab folder; OutputFolderError: ``dst`` is, contains or lies inside
        ``src``, holds files moelab did not write, or (a ``FileExistsError`` too) is not
        empty and not ``overwrite`` — checked before anything is read.
    """
    src, dst = Path(src), Path(dst)
    check_output_folder(dst, inputs=[src], overwrite=overwrite)
    if direction == "moelab":
        model, meta = import_hf(src)
        if arch is not None and arch != meta.arch:
            raise InteropError(f"arch: {src} is a {meta.arch!r} checkpoint, not {arch!r}")

        def fill(tmp: Path) -> list[str]:
            copied = copy_tokenizer(src, tmp)  # first: the manifest checksums these files too
            save_model(model, tmp, extra_files=copied)
            record = {"arch": meta.arch, "layout": meta.layout, "config": meta.hf_config}
            (tmp / HF_SOURCE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            return copied

        copied = write_folder_atomically(dst, fill, overwrite, inputs=[src])
        return ConvertReport(dst, direction, meta.arch, meta.layout, copied, meta.notes)
    if direction == "hf":
        model = load_model(src)
        base = None
        record_path = src / HF_SOURCE_FILE
        if record_path.is_file():
            record = read_json(record_path)
            base = record.get("config")
            arch = arch or record.get("arch")
        arch = arch or infer_arch(model.cfg)
        if arch not in ARCHS:
            raise InteropError(f"arch: must be one of {sorted(ARCHS)}, got {arch!r}")
        export_hf(
            model,
            dst,
            arch,
            layout=layout,
            base_config=base,
            tokenizer_from=src,
            overwrite=overwrite,
        )
        written = ("config.json", "model.safetensors", MARKER)
        copied = [n for n in os.listdir(dst) if n not in written]
        notes = [] if "tokenizer.json" in copied else [f"no tokenizer.json in {src}; none copied"]
        return ConvertReport(dst, direction, arch, layout, sorted(copied), notes)
    raise InvalidValueError(f"direction: must be 'moelab' or 'hf', got {direction!r}")
