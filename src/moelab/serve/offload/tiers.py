"""ZipMoE's two-tier expert cache for one layer: a *full* tier (decompressed weights) and a
*sign-mantissa* (SM) tier (only the raw sign-mantissa bytes; a hit there still reads and
decodes the exponent chunks), each evicting by token-weighted LFU, with one of two admission
rules (``admission``).

Common to both, per request of expert ``e`` with ``tokens`` tokens:

1. the layer-global token-weighted count ``g[e] += tokens`` (never reset);
   ``up = #{e' : g[e'] > g[e]}`` is ``e``'s rank among the layer's experts;
2. ``T_full = n_full + margin·E`` and ``T_sm = T_full + n_sm + margin·E`` (``margin = 0.1``,
   the code's ``hyperparam_state_margin``).

``"authors"`` (default): ``cache.cpp::ProactiveDecision`` [C], called on every request:

- ``up < T_full``: full if a full slot is free, else SM if an SM slot is free, else full,
  evicting the full tier's token-LFU minimum (unconditionally);
- ``up < T_sm``: SM if free, else full if free, else SM, evicting the SM tier's minimum;
- otherwise: SM if free, else full if free, else not cached.

``"hysteresis"`` (this project's earlier reading of the research notes, kept as an option
[I]): ``up < T_full`` caches as full, ``up < T_sm`` as SM, otherwise not cached unless a slot
is free (full first); a tier with no free slot evicts the token-LFU minimum only among its
residents that have left its hot set (``up >= T_full`` for full, ``up >= T_sm`` for SM), and
when every resident is still hot the expert falls through to SM, then to not caching — the
margin acting as hysteresis against swapping experts of nearly equal counts.

Our choices under both [I]: a full-tier resident stays there (a hit); an SM resident whose
decision is "full" is promoted and its SM slot freed, otherwise it stays in SM (an SM hit); an
expert evicted from the full tier is dropped (not demoted to SM); a tier with no slots at all
is never chosen (the authors' planner always gives both tiers slots; its LFU fallback and the
``argmin`` planner may not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moelab.errors import InvalidValueError
from moelab.serve.offload.policies import TokenLFU

MARGIN = 0.1
ADMISSIONS = ("authors", "hysteresis")


@dataclass
class TierAccess:
    """``before``: ``"full"``, ``"sm"`` or ``"miss"``; ``after``: the tier the expert is kept
    in afterwards (``None`` = not cached); ``evicted``: ``(expert, tier)`` pairs dropped."""

    before: str
    after: str | None
    evicted: list[tuple[int, str]] = field(default_factory=list)


class TwoTierCache:
    """Full + SM tiers of one layer with ``n_full`` and ``n_sm`` slots over ``num_experts``,
    admitting by ``admission`` (``"authors"`` or ``"hysteresis"``, see the module doc).

    Raises:
        ValueError: negative slot counts, ``num_experts < 1`` or an unknown ``admission``.
    """

    def __init__(
        self,
        n_full: int,
        n_sm: int,
        num_experts: int,
        margin: float = MARGIN,
        admission: str = "authors",
    ) -> None:
        if admission not in ADMISSIONS:
            raise InvalidValueError(
                f"admission: must be one of {', '.join(ADMISSIONS)}; got {admission!r}"
            )
        self.admission = admission
        if n_full < 0 or n_sm < 0:
            raise InvalidValueError(f"n_full, n_sm: must be >= 0, got {n_full}, {n_sm}")
        if num_experts < 1:
            raise InvalidValueError(f"num_experts: must be >= 1, got {num_experts}")
        self.n_full, self.n_sm, self.E = n_full, n_sm, num_experts
        self.t_full = n_full + margin * num_experts
        self.t_sm = self.t_full + n_sm + margin * num_experts
        self.full: set[int] = set()
        self.sm: set[int] = set()
        self.lfu_full = TokenLFU()
        self.lfu_sm = TokenLFU()
        self.global_count = [0] * num_experts

    def tier_of(self, e: int) -> str:
        return "full" if e in self.full else "sm" if e in self.sm else "miss"

    def rank(self, e: int) -> int:
        """``up``: how many experts have a strictly higher global token count than ``e``."""
        g = self.global_count[e]
        return sum(1 for c in self.global_count if c > g)

    def _evict(self, e: int, tier: str) -> tuple[int, str]:
        if tier == "full":
            self.full.discard(e)
            self.lfu_full.on_evict(e)
        else:
            self.sm.discard(e)
            self.lfu_sm.on_evict(e)
        return e, tier

    def _place(self, e: int, tier: str, tokens: int) -> None:
        (self.full if tier == "full" else self.sm).add(e)
        (self.lfu_full if tier == "full" else self.lfu_sm).on_insert(e, tokens)

    def _make_room(self, tier: str, threshold: float, evicted: list[tuple[int, str]]) -> bool:
        """Free a slot of ``tier`` if possible: a free slot, or evict the token-LFU minimum
        among the residents that are no longer in the tier's hot set (``up >= threshold``)."""
        slots, resident = (self.n_full, self.full) if tier == "full" else (self.n_sm, self.sm)
        if slots == 0:
            return False
        if len(resident) < slots:
            return True
        cold = [v for v in resident if self.rank(v) >= threshold]
        if not cold:
            return False
        lfu = self.lfu_full if tier == "full" else self.lfu_sm
        evicted.append(self._evict(lfu.victim(cold), tier))
        return True

    def access(self, e: int, tokens: int = 1) -> TierAccess:
        """Request expert ``e`` for ``tokens`` tokens; update counts, tiers and policy state."""
        if not 0 <= e < self.E:
            raise InvalidValueError(f"expert: must be in [0, {self.E}), got {e}")
        self.global_count[e] += tokens
        before = self.tier_of(e)
        if before == "full":
            self.lfu_full.on_hit(e, tokens)
            return TierAccess(before, "full")
        up = self.rank(e)
        if self.admission == "authors":
            return self._proactive(e, before, up, tokens)
        return self._hysteresis(e, before, up, tokens)

    def _decision(self, up: int) -> tuple[str | None, bool]:
        """``ProactiveDecision``'s tier for rank ``up`` and whether taking it needs an
        eviction (a tier with no slots is never chosen [I])."""
        free = {"full": len(self.full) < self.n_full, "sm": len(self.sm) < self.n_sm}
        has = {"full": self.n_full > 0, "sm": self.n_sm > 0}
        if up < self.t_full:
            order, forced = ("full", "sm"), ("full", "sm")
        elif up < self.t_sm:
            order, forced = ("sm", "full"), ("sm", "full")
        else:
            order, forced = ("sm", "full"), ()
        for tier in order:
            if free[tier]:
                return tier, False
        for tier in forced:
            if has[tier]:
                return tier, True
        return None, False

    def _proactive(self, e: int, before: str, up: int, tokens: int) -> TierAccess:
        tier, evict = self._decision(up)
        if before == "sm" and tier != "full":
            self.lfu_sm.on_hit(e, tokens)
            return TierAccess(before, "sm")
        evicted: list[tuple[int, str]] = []
        if tier is None:
            return TierAccess(before, None)
        if evict:
            resident = self.full if tier == "full" else self.sm
            lfu = self.lfu_full if tier == "full" else self.lfu_sm
            evicted.append(self._evict(lfu.victim(list(resident)), tier))
        if before == "sm":  # promotion to full frees the SM slot
            self.sm.discard(e)
            self.lfu_sm.on_evict(e)
        self._place(e, tier, tokens)
        return TierAccess(before, tier, evicted)

    def _hysteresis(self, e: int, before: str, up: int, tokens: int) -> TierAccess:
        evicted: list[tuple[int, str]] = []
        if up < self.t_full and self._make_room("full", self.t_full, evicted):
            if before == "sm":
                self.sm.discard(e)
                self.lfu_sm.on_evict(e)
            self._place(e, "full", tokens)
            return TierAccess(before, "full", evicted)
        if before == "sm":
            self.lfu_sm.on_hit(e, tokens)
            return TierAccess(before, "sm", evicted)
        if up < self.t_sm and self._make_room("sm", self.t_sm, evicted):
            self._place(e, "sm", tokens)
            return TierAccess(before, "sm", evicted)
        if len(self.full) < self.n_full:
            self._place(e, "full", tokens)
            return TierAccess(before, "full", evicted)
        if len(self.sm) < self.n_sm:
            self._place(e, "sm", tokens)
            return TierAccess(before, "sm", evicted)
        return TierAccess(before, None, evicted)
