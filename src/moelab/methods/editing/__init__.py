"""Lifelong knowledge editing: TIME's CP-tensor edit experts with intrinsic routing, and the
LoRA + key, GRACE and FT-L baselines, on one linear layer of a frozen causal LM.

Paper: "TIME: Tensor-Factorized Mixture-of-Experts with Intrinsic Routing for Lifelong
Multimodal Knowledge Editing", ICML 2026 (METHODS.md #18; poster 64179). Only its abstract is
public, so the method here is this project's formalisation, labelled "inferred"
(``EditConfig.time_formalisation``; :mod:`.cp`); the protocol and metrics follow LiveEdit's
code (:mod:`.metrics`, :mod:`.recipe`); the benchmark, GeoFacts, edits country capitals in
SmolLM2-135M (:mod:`.geofacts`).

Entry points: :class:`~moelab.methods.editing.editor.Editor` (apply a stream, restore),
:func:`~moelab.methods.editing.io.save_edits` / :func:`~moelab.methods.editing.io.load_edits`,
:class:`~moelab.methods.editing.recipe.TimeEditingRecipe` (for
:func:`moelab.methods.runner.run_seeds`); ``moelab edit apply``; ``benchmarks/time_editing.py``.
"""

from moelab.methods.editing.config import METHODS, EditConfig
from moelab.methods.editing.cp import CPEditBank, cp_parameter_count, cp_scores, square_factors
from moelab.methods.editing.editor import Editor
from moelab.methods.editing.grace import GraceBank
from moelab.methods.editing.io import EditStateError, is_edit_folder, load_edits, save_edits
from moelab.methods.editing.layer import EditBank, EditedLinear
from moelab.methods.editing.lora_key import LoRAKeyBank
from moelab.methods.editing.metrics import edit_score, token_accuracy
from moelab.methods.editing.recipe import TimeEditingRecipe
from moelab.methods.editing.requests import EditRequest, read_edits, tokenize_edit

__all__ = [
    "METHODS",
    "CPEditBank",
    "EditBank",
    "EditConfig",
    "EditRequest",
    "EditStateError",
    "EditedLinear",
    "Editor",
    "GraceBank",
    "LoRAKeyBank",
    "TimeEditingRecipe",
    "cp_parameter_count",
    "cp_scores",
    "edit_score",
    "is_edit_folder",
    "load_edits",
    "read_edits",
    "save_edits",
    "square_factors",
    "token_accuracy",
    "tokenize_edit",
]
