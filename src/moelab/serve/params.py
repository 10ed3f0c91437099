"""Per-request generation settings (what an OpenAI ``completions`` request controls)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moelab.errors import InvalidValueError


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is generated.

    Attributes:
        max_tokens: most new tokens (>= 1).
        temperature: 0 = greedy; otherwise logits are divided by it (finite, >= 0).
        top_k: keep the k most likely tokens (None = all).
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: seeds this sequence's own ``torch.Generator``, so its samples do not depend on
            what else is in the batch; None = a fresh random seed.
        stop_ids: token ids that end the sequence (not emitted).
        stop: strings that end the sequence (the text is cut before the match).
        routing: also report, per generated token, the experts each MoE layer chose.
        timeout_s: wall-clock limit from submission (None = no limit).

    Raises:
        ValueError: any field outside the ranges above (naming the field).
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
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidValueError(
                f"temperature: must be a finite number >= 0, got {self.temperature}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise InvalidValueError(f"top_k: must be >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidValueError("stop: strings must be non-empty")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise InvalidValueError(f"timeout_s: must be > 0, got {self.timeout_s}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6
