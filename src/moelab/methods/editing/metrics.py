"""Editing metrics, LiveEdit's definitions (``evaluation/vllm_editor_eval.py``,
``__get_results_after_edit__`` [C]): teacher-forced token accuracy, in percent.

* reliability / generality: per prompt, the fraction of target positions whose argmax is the
  new target token; the mean over prompts;
* locality: the same with the *unedited* model's argmax as the reference (agreement).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.errors import InvalidValueError


def token_accuracy(predicted: Sequence[Tensor], reference: Sequence[Tensor]) -> float:
    """Mean over prompts of the fraction of positions where ``predicted`` (argmax ids, one
    1-D tensor per prompt) equals ``reference`` (targets, or the pre-edit argmax), in %.

    Raises:
        InvalidValueError: no prompts, different counts, or a prompt whose two tensors
            differ in length or are empty.
    """
    if not predicted or len(predicted) != len(reference):
        raise InvalidValueError(
            f"predicted, reference: need the same non-zero number of prompts, got "
            f"{len(predicted)} and {len(reference)}"
        )
    per_prompt = []
    for i, (p, r) in enumerate(zip(predicted, reference, strict=True)):
        if p.shape != r.shape or p.numel() == 0:
            raise InvalidValueError(
                f"prompt {i}: predicted {tuple(p.shape)} and reference {tuple(r.shape)} must "
                "be equal non-empty shapes"
            )
        per_prompt.append((p == r).double().mean())
    return 100.0 * float(torch.stack(per_prompt).mean())


def edit_score(
    reliability: float, generality: float, locality_neighbour: float, locality_subject: float
) -> float:
    """The claim's score: the mean of the four metrics (each in %)."""
    return (reliability + generality + locality_neighbour + locality_subject) / 4
