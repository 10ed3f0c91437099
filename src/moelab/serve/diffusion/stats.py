"""Exact decoding counters from the routing decisions (TEAM's APF, TPF, APT; NFE; wall time)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Counters of one or more decodes.

    Attributes:
        forwards: per forward (prefill of the prompt's complete blocks excluded), the number
            of distinct experts activated in each MoE layer (a list with one int per layer).
            Speculative branches share one forward; reused (cached) tokens activate nothing.
        accepted: per forward, how many tokens it accepted (a finished block's KV-storing
            forward accepts 0).
        wall_s: seconds spent decoding (prefill included).

    Derived (TEAM §4): ``APF`` = mean over forwards and MoE layers of the distinct experts,
    ``TPF`` = accepted tokens / forwards, ``APT = APF / TPF``, ``NFE`` = forwards.
    """

    forwards: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    wall_s: float = 0.0

    def add(self, experts_per_layer: list[int], accepted: int) -> None:
        self.forwards.append(list(experts_per_layer))
        self.accepted.append(int(accepted))

    def merge(self, other: DecodeStats) -> None:
        self.forwards += other.forwards
        self.accepted += other.accepted
        self.wall_s += other.wall_s

    @property
    def nfe(self) -> int:
        return len(self.forwards)

    @property
    def tokens(self) -> int:
        return sum(self.accepted)

    @property
    def apf(self) -> float:
        per = [sum(f) / len(f) for f in self.forwards if f]
        return sum(per) / len(per) if per else 0.0

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0

    @property
    def apt(self) -> float:
        return self.apf / self.tpf if self.tpf else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "nfe": self.nfe,
            "tokens": self.tokens,
            "apf": self.apf,
            "tpf": self.tpf,
            "apt": self.apt,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
        }
