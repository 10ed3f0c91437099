"""The zero-shot label-prompt classifier of the X-TAIL protocol on one text encoder, and the
learners built on it: the frozen zero-shot reference, sequential LoRA and MoE-LoRA with a
learned router grown per domain (``wave3-continual.md`` §2.2); MoRAM itself is in
:mod:`moelab.methods.continual.moram`.

Classifier (the text analogue of CLIP's two towers, one tower here [I]): the logit of class
``c`` is ``s·cos(f(x), f(p_c))`` with ``f`` the mean-pooled encoder output, ``p_c`` the class's
label prompt (:attr:`Stream.prompts`) and the fixed scale ``s = 100`` (CLIP's ``logit_scale``
[I]). Adapters sit on the linear layers of copies of the top ``adapted_blocks`` blocks and
adapt both towers, as the authors' ``target_encoder=all`` [C]; the blocks below are the
frozen, cached prefix.

Training on domain ``t`` (``XTAIL/models/moram.py::train_model`` [C]): ``iterations`` AdamW
steps (betas (0.9, 0.9999), weight decay 0, cosine schedule without warm-up) on batches of the
domain's training texts; the loss is

* the image→text cross-entropy over the joint space of the seen and current classes with every
  seen class masked to −inf: the CE over the current domain's classes alone, plus
* the text→image term ``CE(s·E·Xᵀ, M)`` with ``E`` the prompt embeddings of the seen and
  current classes, ``X`` the batch's and ``M[c, b] = 𝟙[y_b = c]`` (unnormalised multi-positive
  targets, mean over the ``S + C`` rows). Rows of seen classes have no positive in the batch
  and add 0 to the sum, so it is computed over the current rows and divided by ``S + C``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.errors import InvalidValueError
from moelab.methods.continual.backbone import adapted_forward
from moelab.methods.continual.heads import PrototypeHead, label_prompt_head
from moelab.methods.continual.learner import Learner
from moelab.models.adapters import (
    LoRALinear,
    MoELoRALinear,
    inject_adapters,
)
from moelab.models.encoder import pool

ADAPTER_STATE = ("lora_", "router.")
"""What a prompt learner saves: the adapter parameters (the copied blocks are the encoder's)."""


def xtail_loss(x: Tensor, prompts: Tensor, y: Tensor, seen: int, scale: float) -> Tensor:
    """The X-TAIL training loss (module docstring) of one batch.

    Args:
        x: ``[B, D]`` input features; prompts: ``[C, D]`` the current classes' prompt features.
        y: ``[B]`` int64 labels in ``[0, C)`` (the current domain's numbering).
        seen: S, the classes of the earlier domains (masked out; they count in the mean).
        scale: s.
    Returns:
        A scalar: ``CE_image→text + CE_text→image``.
    """
    logits = scale * F.normalize(x, dim=-1) @ F.normalize(prompts, dim=-1).T
    ce = F.cross_entropy(logits, y)
    positives = F.one_hot(y, prompts.shape[0]).T.to(logits.dtype)
    ce_t = -(positives * logits.T.log_softmax(dim=1)).sum() / (seen + prompts.shape[0])
    return ce + ce_t


class PromptLearner(Learner):
    """Label-prompt classifier on copies of the top blocks (module docstring).

    Subclasses inject their adapters in :meth:`inject` and list them in :attr:`adapters`.

    Raises:
        InvalidValueError: a stream without label prompts.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.stream.prompts:
            raise InvalidValueError(
                f"method {self.config.method}: needs a stream with label prompts "
                "(stream 'domains' or 'synthetic-domains')"
            )
        self.settings = self.config.moram
        self.cache.add(self.stream.prompts)
        blocks = copy.deepcopy(self.encoder.blocks[self.start_block :]).eval()
        self.model["blocks"] = blocks.requires_grad_(False)
        self.adapters: list[nn.Module] = []
        self.inject()
        self._head: PrototypeHead | None = None
        self.last_mask: Tensor | None = None
        self._task_of = {c: j for j, task in enumerate(self.stream.tasks) for c in task.classes}

    # -- structure --------------------------------------------------------------------------
    def inject(self) -> None:
        """Put the adapters on ``self.model["blocks"]`` (none: the frozen encoder)."""

    def _inject(self, factory) -> None:
        names = inject_adapters(self.model["blocks"], list(self.settings.targets), factory)
        self.adapters = [self.model["blocks"].get_submodule(n) for n in names]

    def set_training(self, training: bool) -> None:
        """Training mode of the adapters only (the copied blocks stay in eval mode: no
        dropout in the frozen backbone)."""
        for m in self.adapters:
            m.train(training)

    # -- features ---------------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> Tensor:
        """Mean-pooled features ``[B, D]`` of cached ``texts`` through the adapted blocks."""
        h, mask = self.cache.batch(texts)
        blocks = self.model["blocks"]
        # adapted_forward runs any object's ``blocks``: here the copies carrying the adapters
        out, _ = adapted_forward(SimpleNamespace(blocks=blocks), h, mask, 0, [None] * len(blocks))
        self.last_mask = mask
        return pool(out, mask)

    def _encode_batched(self, texts: Sequence[str], size: int = 64) -> Tensor:
        texts = list(texts)
        return torch.cat([self.encode(texts[s : s + size]) for s in range(0, len(texts), size)])

    def head(self) -> PrototypeHead:
        """The label-prompt head of every class (78 on the real domains), memoized until the
        next :meth:`learn`."""
        if self._head is None:
            self.set_training(False)
            with torch.no_grad():
                self._head = label_prompt_head(self._encode_batched, self.stream.prompts)
        return self._head

    def logits(self, indices: Sequence[int]) -> Tensor:
        """``[B, C]`` = ``s·cos(f(x), f(p_c))`` over every class of the stream."""
        head = self.head()
        self.set_training(False)
        with torch.no_grad():
            x = self.encode([self.stream.texts[i] for i in indices])
        return self.settings.scale * head(x)

    # -- training ---------------------------------------------------------------------------
    def _cycle(self, indices: Sequence[int]) -> Iterator[list[int]]:
        while True:
            yield from self.shuffled_batches(indices)

    def train_task(self, t: int) -> None:
        """``iterations`` steps of the X-TAIL loss on task ``t`` (module docstring)."""
        s = self.settings
        task = self.stream.tasks[t]
        classes = list(task.classes)
        local = {c: k for k, c in enumerate(classes)}
        seen = sum(len(self.stream.tasks[j].classes) for j in range(t))
        prompts = [self.stream.prompts[c] for c in classes]
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.9999), weight_decay=s.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / s.iterations))
        )
        batches = self._cycle(task.train)
        self.set_training(True)
        for _ in range(s.iterations):
            idx = next(batches)
            feats = self.encode([self.stream.texts[i] for i in idx] + prompts)
            y = torch.tensor([local[self.stream.labels[i]] for i in idx], dtype=torch.long)
            loss = xtail_loss(feats[: len(idx)], feats[len(idx) :], y, seen, s.scale)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        self.set_training(False)

    def learn(self, t: int) -> None:
        self._head = None
        self.grow(t)
        if self.adapters:
            self.train_task(t)
        self.tasks_learned = t + 1

    def grow(self, t: int) -> None:
        """Add what task ``t`` brings before it is trained (nothing by default)."""

    def grow_to(self, tasks: int) -> None:
        for t in range(tasks):
            self.grow(t)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """The adapter parameters only (:data:`ADAPTER_STATE`)."""
        return {k: v for k, v in super().state_dict().items() if any(a in k for a in ADAPTER_STATE)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load :meth:`state_dict`'s output into a learner grown to the same size.

        Raises:
            InvalidValueError: a key this learner lacks, or an adapter parameter missing.
        """
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        lost = [k for k in missing if any(a in k for a in ADAPTER_STATE)]
        if unexpected or lost:
            raise InvalidValueError(f"state: unexpected keys {unexpected}, missing {lost}")
        self._head = None


class ZeroShotLearner(PromptLearner):
    """The frozen encoder's label-prompt classifier: X-TAIL's zero-shot reference. Nothing
    changes along the stream, so the prompt head is built once and the input features are
    the cache's memoized frozen ones."""

    def learn(self, t: int) -> None:
        self.tasks_learned = t + 1

    def logits(self, indices: Sequence[int]) -> Tensor:
        return self.settings.scale * self.head()(self.frozen_features(indices))


class PromptSeqLoRALearner(PromptLearner):
    """One rank-r LoRA (α = r: scale 1, as MoRAM's atoms [I]) per adapted linear layer,
    trained through the whole sequence."""

    def inject(self) -> None:
        r = self.settings.rank
        self._inject(lambda _, m: LoRALinear(m, r, float(r)))


class PromptMoELoRALearner(PromptLearner):
    """MoE-LoRA with a learned router grown per domain: one rank-r LoRA expert per domain per
    layer (α = r [I]), the older experts frozen, a linear softmax router that gains a row per
    domain and stays trainable, top-2 (``moe_top_k``; top-1 while one expert exists). The
    README's "conventional MoE-LoRA adds an indivisible rank-r expert per task" [P], standing
    in for MoE-Adapter without its DDAS autoencoders [I]."""

    def inject(self) -> None:
        r = self.settings.rank
        self._inject(lambda _, m: MoELoRALinear(m, 1, r, float(r), top_k=1))

    def grow(self, t: int) -> None:
        if t == 0:
            return
        for m in self.adapters:
            m.grow(1)
            m.top_k = min(self.settings.moe_top_k, m.num_experts)
