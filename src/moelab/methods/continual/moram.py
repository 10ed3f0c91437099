"""MoRAM (ICML 2026; Artificer-AI-Lab/MoRAM @ aaa51d8e, ``XTAIL/``): rank-1 associative-memory
atoms that route themselves (:class:`~moelab.models.adapters.moram.MoRAMLinear`), r new atoms
per domain with the older ones frozen, trained with the X-TAIL loss of
:mod:`moelab.methods.continual.prompt` on the label-prompt classifier.

Atom-usage diagnostic (``wave3-continual.md`` §2.2): during every evaluation after domain
``t`` the learner reads each adapted layer's :class:`~moelab.core.telemetry.RoutingRecord`
and counts, per real token, the atoms passing δ, split into old atoms (domains ``< t``) and new
ones (domain ``t``), and by the text's domain: seen (``<= t``) or unseen (``> t``, where
MoRAM's gate should fall back to the zero-shot encoder). :meth:`MoRAMLearner.atom_usage`
returns the means per layer and overall.

Labels as in ``wave3-continual.md`` §2: [C] the authors' code, [I] this project's choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moelab.methods.continual.prompt import PromptLearner
from moelab.models.adapters.moram import MoRAMLinear

USAGE_KEYS = ("seen_old", "seen_new", "unseen_old", "unseen_new", "seen_none", "unseen_none")
"""The diagnostic's entries: mean atoms passing δ per token (``*_old``, ``*_new``) and the
fraction of tokens with none (``*_none``: the layer returns the pretrained output)."""


class MoRAMLearner(PromptLearner):
    """MoRAM on the label-prompt classifier (module docstring); ``adapters`` are the
    :class:`MoRAMLinear` layers, in module order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.names = [
            n for n, m in self.model["blocks"].named_modules() if isinstance(m, MoRAMLinear)
        ]
        # per layer: [atoms old, atoms new, tokens with none, tokens] summed, seen / unseen
        self._usage = torch.zeros(len(self.adapters), 2, 4, dtype=torch.float64)

    def inject(self) -> None:
        s = self.settings
        self._inject(
            lambda _, m: MoRAMLinear(m, s.rank, s.topk or None, s.temperature, s.threshold)
        )

    def grow(self, t: int) -> None:
        if t > 0:
            for m in self.adapters:
                m.grow()

    def logits(self, indices: Sequence[int]) -> Tensor:
        out = super().logits(indices)
        self._count(indices)
        return out

    def _count(self, indices: Sequence[int]) -> None:
        """Add the last forward's atom usage (the texts ``indices``) to the diagnostic."""
        t = self.tasks_learned - 1
        mask = self.last_mask
        S = mask.shape[1]
        unseen = torch.tensor(
            [self._task_of[self.stream.labels[i]] > t for i in indices], dtype=torch.long
        )
        group = unseen[:, None].expand(-1, S).reshape(-1)[mask.reshape(-1)]
        real = mask.reshape(-1).nonzero().squeeze(1)
        for k, m in enumerate(self.adapters):
            rec = m.last_record
            n = rec.probs.shape[0]
            pos = torch.full((n,), -1, dtype=torch.long)
            pos[real] = torch.arange(real.numel())
            keep = pos[rec.all_token_idx] >= 0
            tok = pos[rec.all_token_idx[keep]]
            old = (rec.all_expert_idx[keep] < m.num_frozen).to(torch.float64)
            per_old = torch.zeros(real.numel(), dtype=torch.float64).index_add_(0, tok, old)
            per_new = torch.zeros(real.numel(), dtype=torch.float64).index_add_(0, tok, 1 - old)
            none = ((per_old + per_new) == 0).to(torch.float64)
            for g in (0, 1):
                sel = group == g
                parts = (per_old[sel].sum(), per_new[sel].sum(), none[sel].sum())
                self._usage[k, g] += torch.stack([*parts, sel.sum().to(torch.float64)])

    def atom_usage(self) -> dict[str, dict[str, float]]:
        """``{layer name or "all": {key: value}}`` over every evaluation so far (keys:
        :data:`USAGE_KEYS`; NaN where no token of that group was seen)."""
        out = {}
        for name, u in [*zip(self.names, self._usage, strict=True), ("all", self._usage.sum(0))]:
            tokens = u[:, 3].clamp(min=1)
            rows = {}
            for g, group in enumerate(("seen", "unseen")):
                if u[g, 3] == 0:
                    rows.update({f"{group}_{k}": float("nan") for k in ("old", "new", "none")})
                    continue
                rows[f"{group}_old"] = float(u[g, 0] / tokens[g])
                rows[f"{group}_new"] = float(u[g, 1] / tokens[g])
                rows[f"{group}_none"] = float(u[g, 2] / tokens[g])
            out[name] = rows
        return out
