"""Exact decoding counters from the routing decisions (TEAM's APF, TPF, APT; NFE; wall time;
a memory-bound cost proxy)."""

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
        kv: per forward, True for a finished block's KV-storing forward, False for a
            denoising forward.
        wall_s: seconds spent, prefill included.
        prefill_s: the part of ``wall_s`` spent prefilling the prompt's complete blocks.

    Derived (TEAM §4), over the **denoising** forwards, as the authors' expert logs count
    them (``..._speculative_mark.py`` records experts only in the denoising branch) [C]:
    ``APF`` = mean over forwards and MoE layers of the distinct experts, ``TPF`` = accepted
    tokens / forwards, ``APT = APF / TPF``, ``NFE`` = forwards. The ``*_all`` variants count
    the KV-storing forwards too (this project's earlier definition [I]; they pay a full APF
    for 0 tokens, so they dilute a cut in APT). ``tokens_per_s`` is over the decode time only
    (``wall_s - prefill_s``).
    """

    forwards: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    kv: list[bool] = field(default_factory=list)
    wall_s: float = 0.0
    prefill_s: float = 0.0

    def add(self, experts_per_layer: list[int], accepted: int, kv: bool = False) -> None:
        self.forwards.append(list(experts_per_layer))
        self.accepted.append(int(accepted))
        self.kv.append(bool(kv))

    def merge(self, other: DecodeStats) -> None:
        self.forwards += other.forwards
        self.accepted += other.accepted
        self.kv += other.kv
        self.wall_s += other.wall_s
        self.prefill_s += other.prefill_s

    def _denoising(self) -> list[list[int]]:
        return [f for f, kv in zip(self.forwards, self.kv, strict=True) if not kv]

    @staticmethod
    def _apf(forwards: list[list[int]]) -> float:
        per = [sum(f) / len(f) for f in forwards if f]
        return sum(per) / len(per) if per else 0.0

    @property
    def nfe(self) -> int:
        """Denoising forwards."""
        return len(self.forwards) - sum(self.kv)

    @property
    def nfe_all(self) -> int:
        """All forwards (denoising and KV-storing)."""
        return len(self.forwards)

    @property
    def tokens(self) -> int:
        return sum(self.accepted)

    @property
    def apf(self) -> float:
        return self._apf(self._denoising())

    @property
    def apf_all(self) -> float:
        return self._apf(self.forwards)

    @property
    def tpf(self) -> float:
        return self.tokens / self.nfe if self.nfe else 0.0

    @property
    def tpf_all(self) -> float:
        return self.tokens / self.nfe_all if self.nfe_all else 0.0

    @property
    def apt(self) -> float:
        return self.apf / self.tpf if self.tpf else float("inf")

    @property
    def apt_all(self) -> float:
        return self.apf_all / self.tpf_all if self.tpf_all else float("inf")

    @property
    def decode_s(self) -> float:
        """Seconds spent decoding, prefill excluded."""
        return self.wall_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of decoding (prefill excluded)."""
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    def cost_proxy_s(self, dense_s: float, expert_bytes: float, bandwidth: float) -> float:
        """Memory-bound time estimate ``Σ_forwards (dense_s + experts_f · expert_bytes /
        bandwidth)`` over **all** forwards (a KV-storing forward costs time too), where
        ``experts_f`` is the forward's distinct experts summed over the MoE layers: each
        forward reads the dense weights once and every distinct expert once [I: the regime
        the authors' GPU wall-clock gain comes from].

        Args:
            dense_s: seconds of one forward's non-expert work.
            expert_bytes: bytes of one expert's weights.
            bandwidth: bytes per second the experts are read at.
        """
        loaded = sum(sum(f) for f in self.forwards)
        return len(self.forwards) * dense_s + loaded * expert_bytes / bandwidth

    def to_dict(self) -> dict[str, float]:
        return {
            "nfe": self.nfe,
            "nfe_all": self.nfe_all,
            "tokens": self.tokens,
            "apf": self.apf,
            "tpf": self.tpf,
            "apt": self.apt,
            "apf_all": self.apf_all,
            "tpf_all": self.tpf_all,
            "apt_all": self.apt_all,
            "wall_s": self.wall_s,
            "decode_s": self.decode_s,
            "tokens_per_s": self.tokens_per_s,
        }
