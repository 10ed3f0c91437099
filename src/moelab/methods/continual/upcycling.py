"""CKA-guided selective upcycling for task-incremental learning, with its two reference arms
(ICML 2026 poster 64571, *Efficient Bilevel Optimization for CKA-Guided MoE Upcycling*; no code
or full text is public, so everything beyond the abstract is this project's reading,
``wave3-continual.md`` §5 "TRACE-lite" and ``methods-group1.md`` (e), marked [I]).

Every block of the frozen encoder whose states are not cached is a candidate growth site
(:class:`~moelab.methods.continual.growth_site.GrowthSite`). The task is known at test: each
task has its own linear head on the mean-pooled last features, and a prediction is its task's
head's argmax. After each task the learner keeps ``replay_per_task`` of its training texts
(:class:`~moelab.methods.continual.replay.ClassReservoir` keyed by task) and mixes
``replay_batch`` of them into every later step (CE through their own task's head; old heads
stay trainable [I]).

Arms (:data:`ARMS`):

* ``seqft-replay`` — sequential fine-tuning with replay: every FFN trainable, no growth.
* ``full-upcycling`` — every site grows one expert per task (copied from the pretrained FFN,
  a zero router row, the older experts frozen), top-2 routing, routers trainable.
* ``selective-upcycling`` — every site grows a candidate expert; a per-site Gumbel mask
  (:class:`~moelab.train.gumbel_mask.GumbelLayerMask`, straight-through hard samples,
  τ annealed 1 → 0.1) chooses keep or grow. Inner steps (the weights) minimise task CE + replay
  CE + ``λ_cka·Σ_l (1 − CKA(F_l^prev(X_r), F_l(X_r)))`` (linear CKA,
  :func:`moelab.analysis.cka.linear_cka`, of the mean-pooled block outputs of the replay batch
  under the model at the end of the previous task and now); every ``outer_every`` inner steps
  one first-order outer step on α minimises CE on held-out task texts + replay plus
  ``λ_p·Σ_l P(grow_l)·|θ_new,l| / |θ_base|``. Then the mask is discretised
  (``argmax α_l``), rejected candidates are removed, and the rest of the steps fine-tune.

After each task every expert is frozen, and the learner records which sites grew, the expert
parameters added and the per-layer CKA between a fixed probe set's features before and after
the task (:meth:`UpcyclingLearner.details`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.analysis.cka import layer_cka, linear_cka
from moelab.methods.continual.growth_site import GrowthSite, sites_forward
from moelab.methods.continual.learner import Learner
from moelab.methods.continual.replay import ClassReservoir
from moelab.models.bert_moe import expert_parameters
from moelab.train.gumbel_mask import GumbelLayerMask, annealed_temperature


class UpcyclingLearner(Learner):
    """Base of the three arms (module docstring); :attr:`arm` names the arm."""

    arm = "seqft-replay"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s = self.config.upcycling
        blocks = self.encoder.blocks[self.start_block :]
        trainable = self.arm == "seqft-replay"
        self.model["sites"] = nn.ModuleList(GrowthSite(b.ffn, trainable) for b in blocks)
        self.model["heads"] = nn.ModuleList()
        self.memory = ClassReservoir(s.replay_per_task, seed=int(self.generator.initial_seed()))
        self.task_of = {i: t for t, task in enumerate(self.stream.tasks) for i in task.train}
        self.expert_size = expert_parameters(blocks[0].ffn)
        self.base_size = sum(p.numel() for p in self.encoder.parameters())
        self.growth: list[list[bool]] = []
        self.cka_curves: list[list[float]] = []
        self.grow_probs: list[list[float]] = []
        tests = [i for task in self.stream.tasks for i in task.test]
        order = torch.randperm(len(tests), generator=self.generator)[: s.probe_size].tolist()
        self.probe = [tests[k] for k in order]

    @property
    def sites(self) -> nn.ModuleList:
        return self.model["sites"]

    # -- forward ----------------------------------------------------------------------------
    def features(self, indices: Sequence[int], gates: Tensor | None = None):
        """``(last features [B, D], per-site block features [B, D] each)``."""
        h, mask = self.hidden(indices)
        return sites_forward(self.encoder, h, mask, self.start_block, self.sites, gates)

    def logits(self, indices: Sequence[int]) -> Tensor:
        self.model.eval()
        with torch.no_grad():
            f, _ = self.features(indices)
        out = torch.full((len(indices), self.stream.seen_classes(self.tasks_learned - 1)), -1e9)
        for t, head in enumerate(self.model["heads"]):
            out[:, list(self.stream.tasks[t].classes)] = head(f)
        return out

    def _ce(self, feats: Tensor, indices: Sequence[int]) -> Tensor:
        """Mean CE of every row through its own task's head."""
        labels = self.labels(indices)
        tasks = torch.tensor([self.task_of[i] for i in indices])
        total = feats.new_zeros(())
        for t in tasks.unique().tolist():
            rows = (tasks == t).nonzero().squeeze(1)
            first = self.stream.tasks[t].classes[0]
            total = total + F.cross_entropy(
                self.model["heads"][t](feats[rows]), labels[rows] - first, reduction="sum"
            )
        return total / len(indices)

    def _layer_features(self, indices: Sequence[int]) -> list[Tensor]:
        self.model.eval()
        with torch.no_grad():
            return self.features(indices)[1]

    # -- training ---------------------------------------------------------------------------
    def _batches(self, indices: Sequence[int]) -> Iterator[list[int]]:
        while True:
            yield from self.shuffled_batches(indices)

    def _replay(self) -> list[int]:
        return [i for i, _ in self.memory.sample(self.config.upcycling.replay_batch)]

    def _inner_loss(
        self, idx: list[int], replay: list[int], gates: Tensor | None, snapshot: dict | None
    ) -> Tensor:
        rows = idx + replay
        feats, layers = self.features(rows, gates)
        loss = self._ce(feats, rows)
        if snapshot is not None and replay:
            w = self.config.upcycling.cka_weight
            for site, f in enumerate(layers):
                prev = torch.stack([snapshot[i][site] for i in replay])
                loss = loss + w * (1.0 - linear_cka(prev, f[len(idx) :]))
        return loss

    def _train(
        self,
        t: int,
        indices: Sequence[int],
        steps: int,
        snapshot: dict | None = None,
        mask: GumbelLayerMask | None = None,
        holdout: Sequence[int] = (),
    ) -> None:
        s = self.config.upcycling
        heads = list(self.model["heads"].parameters())
        head_ids = {id(p) for p in heads}
        weights = [p for p in self.sites.parameters() if p.requires_grad and id(p) not in head_ids]
        groups = [{"params": heads, "lr": s.head_lr}]
        if weights:
            groups.append({"params": weights, "lr": s.lr})
        opt = torch.optim.Adam(groups)
        mask_opt = None if mask is None else torch.optim.Adam(mask.parameters(), lr=s.mask_lr)
        ratio = self.expert_size / self.base_size
        batches, held = self._batches(indices), self._batches(holdout) if holdout else None
        self.model.train()
        for step in range(steps):
            gates = None
            if mask is not None:
                tau = annealed_temperature(step, steps, s.tau_start, s.tau_end)
                gates = mask.sample(tau, self.generator)
            replay = self._replay() if t else []
            loss = self._inner_loss(next(batches), replay, gates, snapshot)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if mask_opt is not None and held is not None and (step + 1) % s.outer_every == 0:
                rows = next(held) + (self._replay() if t else [])
                feats, _ = self.features(rows, mask.sample(tau, self.generator))
                outer = self._ce(feats, rows) + s.size_weight * ratio * mask.grow_probs().sum()
                mask_opt.zero_grad(set_to_none=True)
                outer.backward()
                mask_opt.step()
        opt.zero_grad(set_to_none=True)
        self.model.eval()

    def _grow(self, t: int, snapshot: dict | None) -> list[bool]:
        """Grow the sites for task ``t`` and train; returns which sites grew."""
        train = list(self.stream.tasks[t].train)
        if self.arm == "seqft-replay":
            self._train(t, train, self.config.upcycling.steps)
            return [False] * len(self.sites)
        for site in self.sites:
            site.grow()
        self._train(t, train, self.config.upcycling.steps)
        return [True] * len(self.sites)

    def learn(self, t: int) -> None:
        task = self.stream.tasks[t]
        self.model["heads"].append(nn.Linear(self.encoder.cfg.hidden_size, len(task.classes)))
        before = self._layer_features(self.probe)
        memory = [i for c in self.memory.classes() for i in self.memory.items(c)]
        snapshot = None
        if memory and self.arm == "selective-upcycling":
            snapshot = dict(zip(memory, torch.stack(self._layer_features(memory), 1), strict=True))
        grown = self._grow(t, snapshot)
        for site in self.sites:
            site.settle()
        self.memory.add(task.train, [t] * len(task.train))
        self.growth.append(grown)
        self.cka_curves.append(layer_cka(before, self._layer_features(self.probe)))
        self.tasks_learned = t + 1

    # -- reporting and state ----------------------------------------------------------------
    def growth_metrics(self) -> dict[str, float]:
        """``expert_params_added`` (parameters of the grown experts), ``growth_vs_full`` (%
        of what full upcycling adds over the same tasks) and ``grown_sites`` (growths)."""
        grown = sum(sum(g) for g in self.growth)
        full = len(self.growth) * len(self.sites)
        return {
            "expert_params_added": float(grown * self.expert_size),
            "growth_vs_full": 100.0 * grown / full if full else 0.0,
            "grown_sites": float(grown),
        }

    def details(self) -> dict[str, list]:
        """Per task: which sites grew, the CKA curve (probe features before vs after the task,
        per site) and, for the selective arm, the final P(grow) per site."""
        return {
            "growth": [[int(g) for g in row] for row in self.growth],
            "cka": [list(row) for row in self.cka_curves],
            "grow_probs": [list(row) for row in self.grow_probs],
            "first_block": self.start_block,
        }

    def state_dict(self) -> dict[str, Tensor]:
        state = super().state_dict()
        state["growth"] = torch.tensor(self.growth, dtype=torch.int8).reshape(-1, len(self.sites))
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Rebuild the sites' experts from the saved growth record, then load the weights."""
        state = dict(state)
        growth = state.pop("growth").tolist()
        for s, site in enumerate(self.sites):
            for row in growth:
                if row[s]:
                    site.grow()
            site.settle()
        self.growth = [[bool(g) for g in row] for row in growth]
        super().load_state_dict(state)

    def grow_to(self, tasks: int) -> None:
        for t in range(tasks):
            n = len(self.stream.tasks[t].classes)
            self.model["heads"].append(nn.Linear(self.encoder.cfg.hidden_size, n))


class SeqFTReplayLearner(UpcyclingLearner):
    """Sequential fine-tuning with replay (every FFN trainable, no growth)."""

    arm = "seqft-replay"


class FullUpcyclingLearner(UpcyclingLearner):
    """Every site grows one expert per task."""

    arm = "full-upcycling"


class SelectiveUpcyclingLearner(UpcyclingLearner):
    """Gumbel-mask search over the sites with CKA-regularised replay, then fine-tuning."""

    arm = "selective-upcycling"

    def _grow(self, t: int, snapshot: dict | None) -> list[bool]:
        s = self.config.upcycling
        train = list(self.stream.tasks[t].train)
        order = torch.randperm(len(train), generator=self.generator).tolist()
        n_hold = max(1, round(s.holdout * len(train)))
        holdout = [train[k] for k in order[:n_hold]]
        inner = [train[k] for k in order[n_hold:]]
        for site in self.sites:
            site.grow()
        mask = GumbelLayerMask(len(self.sites))
        search = max(1, round(s.search_fraction * s.steps))
        self._train(t, inner, search, snapshot, mask, holdout)
        decision = mask.decide()
        self.grow_probs.append([float(p) for p in mask.grow_probs().detach()])
        for site, keep in zip(self.sites, decision, strict=True):
            if not keep:
                site.reject()
        if s.steps > search:
            self._train(t, train, s.steps - search, snapshot)
        return decision


LEARNERS: dict[str, type[UpcyclingLearner]] = {
    c.arm: c for c in (SeqFTReplayLearner, FullUpcyclingLearner, SelectiveUpcyclingLearner)
}
