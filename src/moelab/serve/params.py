"""Per-request generation settings (what an OpenAI ``completions`` request controls)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moelab.errors import InvalidValueError
from moelab.serve.sampling import check_sampling
from moelab.utils.fields import check_seed


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated.

    Attributes:
        max_tokens: most new tokens (>= 1).
        temperature: 0 = greedy; otherwise logits are divided by it (>= 0, finite in float32).
        top_k: keep the k most likely tokens (None = all).
        top_p: nucleus mass in (0, 1] (1 = off; above 0 in float32).
        seed: seeds this sequence's own ``torch.Generator``, so its samples do not depend on
            what else is in the batch; None = a fresh random seed; in ``[0, 2**64)``.
        stop_ids: token ids that end the sequence (not emitted).
        stop: strings that end the sequence (the text is cut before the match).
        routing: also report, per generated token, the experts each MoE layer chose.
        timeout_s: wall-clock limit from submission (None = no limit; finite, > 0).

    Raises:
        ValueError: any field outside the ranges above (naming the field; sampling settings
            as :func:`~moelab.serve.sampling.check_sampling`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    routing: bool = False
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidValueError(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None:
            check_seed(self.seed)
        if any(not s for s in self.stop):
            raise InvalidValueError("stop: strings must be non-empty")
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise InvalidValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6
