"""CaRE: continual learning with bi-level routing MoE adapters on a frozen pretrained model
(ICML 2026; code LMMMEng/CaRE @ d90800a0, ``models/care.py`` [C]; ``wave3-continual.md`` §1).

Per task ``t`` (``_train`` [C]):

* every adapted block's :class:`~moelab.methods.continual.brmoe.BRMoE` grows an expert, a
  router and a latent head; the cosine head grows a block of classes (all heads trainable);
* task 0: ``first_task_epochs`` epochs, SGD (momentum 0.9, weight decay) with a cosine
  schedule ``lr → 0``; then the new classes' feature Gaussians;
* task ``t > 0``: ``epochs/2`` epochs ``lr → lr/2``, Gaussians, classifier alignment, then
  ``epochs/2`` epochs from ``lr/2`` (the first half's last lr) to 0, Gaussians again (they
  replace the first ones), alignment again. The shared adapter is pinned during both halves.

Loss per batch (``_init_train`` [C]): CosFace on the new classes' cosines (``s = 20``), plus
the mean over adapted blocks of ``(CosFace(latent) + τ²·KL(softmax(cos/τ) ‖ softmax(latent/τ)))
/ 2``: the hard term applies the scale to the raw latent logits, the teacher is the
**unscaled** cosine of the new classes (nearly flat targets), ``τ = 1`` for the first six
adapted blocks and 2 after.

Training and the Gaussians use the task-id (semi-dynamic) forward; prediction the
full-dynamic forward alone (``iter_pred`` off, as the long-sequence OB1K config [C]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.methods.continual.align import ClassGaussians, align_classifier
from moelab.methods.continual.brmoe import BRMoE
from moelab.methods.continual.heads import CosineHead
from moelab.methods.continual.learner import Learner, cosface


class CaRELearner(Learner):
    """CaRE (module docstring); ``model`` holds ``layers`` (one BR-MoE per adapted block) and
    ``head`` (the cosine classifier)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.config
        D = self.encoder.cfg.hidden_size
        n = len(self.encoder.blocks) - self.start_block
        self.model["layers"] = nn.ModuleList(
            BRMoE(
                D,
                c.expert_dim,
                c.shared_dim,
                c.topk_experts,
                c.topk_routers,
                c.adapter_dropout,
                c.routing_token,
            )
            for _ in range(n)
        )
        self.model["head"] = CosineHead(D)
        self.gaussians = ClassGaussians()

    @property
    def layers(self) -> nn.ModuleList:
        return self.model["layers"]

    @property
    def head(self) -> CosineHead:
        return self.model["head"]

    def features(self, indices: Sequence[int], task: int | None) -> tuple[Tensor, list]:
        adapters = [lambda a, m, layer=layer: layer(a, m, task) for layer in self.layers]
        return self.features_with(indices, adapters)

    def _grow(self, t: int) -> None:
        n = len(self.stream.tasks[t].classes)
        for layer in self.layers:
            layer.grow(n)
        self.head.grow(n)

    def grow_to(self, tasks: int) -> None:
        for t in range(tasks):
            self._grow(t)

    def _phase(self, t: int, epochs: int, lr: float, lr_end: float, pinned: bool) -> float:
        """Train ``epochs`` epochs on task ``t``; returns the last learning rate."""
        c = self.config
        known = self.stream.seen_classes(t) - len(self.stream.tasks[t].classes)
        adapter_params = [p for p in self.layers.parameters() if p.requires_grad]
        opt = torch.optim.SGD(
            [
                {"params": adapter_params, "lr": lr, "weight_decay": c.weight_decay},
                {"params": list(self.head.parameters()), "lr": lr, "weight_decay": c.weight_decay},
            ],
            lr=lr,
            momentum=0.9,
        )
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs, eta_min=lr_end)
        for layer in self.layers:
            layer.set_anchor() if pinned else layer.clear_anchor()
        self.layers.train()
        train = self.stream.tasks[t].train
        for _ in range(epochs):
            for idx in self.shuffled_batches(train):
                for layer in self.layers:
                    layer.pin_shared(c.ema_decay)
                y = self.labels(idx) - known
                feats, sides = self.features(idx, t)
                cos = self.head(feats)[:, known:]
                loss_main = cosface(cos, y, c.scale, c.margin)
                teacher = cos.detach()
                aux = []
                for i, side in enumerate(sides):
                    term = cosface(side.latent, y, c.scale, c.margin)
                    if c.self_distill:
                        tau = 1.0 if i < 6 else 2.0
                        soft = F.kl_div(
                            F.log_softmax(side.latent / tau, -1),
                            F.softmax(teacher / tau, -1),
                            reduction="batchmean",
                        )
                        term = (term + soft * tau**2) / 2
                    aux.append(term)
                loss = loss_main + sum(aux) / len(aux)
                opt.zero_grad()
                loss.backward()
                opt.step()
            sched.step()
        for layer in self.layers:
            layer.clear_anchor()
        return opt.param_groups[0]["lr"]

    def _fit_gaussians(self, t: int) -> None:
        self.layers.eval()
        train = list(self.stream.tasks[t].train)
        with torch.no_grad():
            feats = torch.cat(
                [self.features(train[s : s + 64], t)[0] for s in range(0, len(train), 64)]
            )
        self.gaussians.fit(feats, self.labels(train), list(self.stream.tasks[t].classes))

    def _align(self, t: int) -> None:
        c = self.config
        total = self.stream.seen_classes(t)
        align_classifier(
            self.head,
            self.gaussians,
            known=total - len(self.stream.tasks[t].classes),
            total=total,
            task=t,
            epochs=c.ca_epochs,
            lr=c.ca_lr,
            scale=c.scale,
            batch_size=c.batch_size,
            decay=c.decay,
            generator=self.generator,
        )

    def learn(self, t: int) -> None:
        c = self.config
        self._grow(t)
        if t == 0:
            self._phase(t, c.first_task_epochs, c.lr, 0.0, pinned=False)
            self._fit_gaussians(t)
        else:
            half = c.epochs // 2
            lr = self._phase(t, half, c.lr, c.lr / 2, pinned=True)
            self._fit_gaussians(t)
            self._align(t)
            self._phase(t, half, lr, 0.0, pinned=True)
            self._fit_gaussians(t)
            self._align(t)
        self.tasks_learned = t + 1

    def logits(self, indices: Sequence[int]) -> Tensor:
        self.layers.eval()
        return self.head(self.features(indices, None)[0])

    def routing(self, indices: Sequence[int]) -> Tensor:
        """``[B]``: the lowest-entropy latent head of the last adapted block at test (the
        task whose router the first level picks first); 0 before the second task."""
        self.layers.eval()
        with torch.no_grad():
            side = self.features(indices, None)[1][-1]
        if side.entropies is None:
            return torch.zeros(len(indices), dtype=torch.long)
        return side.entropies.argmin(0)

    def state_dict(self) -> dict[str, Tensor]:
        state = super().state_dict()
        state.update({f"gaussians.{k}": v.clone() for k, v in self.gaussians.state().items()})
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        g = {k[len("gaussians.") :]: v for k, v in state.items() if k.startswith("gaussians.")}
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith("gaussians.")})
        self.gaussians.load(g)
