"""SAME (ICML 2026; LAMDA-CL/Prism) and its baselines on "text-MCIT", continual instruction
tuning of a frozen MiniLM (``wave3-continual.md`` §3.2).

The protocol [I]: every text becomes ``"{instruction} [SEP] {input}"`` with one of 4 paraphrases
of its task's instruction (chosen by a hash of the text, so every arm and seed sees the same
prompt); the answer is one string of a vocabulary shared by all tasks (every class of the
stream), scored by ``logit_scale · cos(feature, e_c)`` with ``e_c`` the frozen encoder's
embedding of ``"answer: {label prompt}"``, a frozen LM head. Training is cross-entropy over the
whole vocabulary (an LM's softmax covers every answer), so a wrong task identification costs
accuracy, as in MCIT. The adapters sit on the FFN's two linears (``up``, ``down``) of the top
``adapted_blocks`` blocks; the lower blocks are cached.

* :class:`SAMELearner`: :class:`~moelab.methods.continual.same_layer.SAMELinear` on every
  target, E = one expert per task, the stabilisers and the task prior; it also evaluates the
  same weights with π uniform (the mandatory "SAME without the prior" ablation) and keeps
  both accuracy matrices.
* :class:`MoELoRALearner`: :class:`~moelab.models.adapters.bilinear_lora.BilinearMoELoRALinear`
  (per-token softmax routing, the same A/B coupling, no stabiliser, no prior) [C].
* :class:`SeqLoRALearner`: one :class:`~moelab.models.adapters.lora.LoRALinear` of rank r.

Router drift (MoE arms): the routing of task 0's test texts after task 0 and after the last
task, per adapted layer. A text's routing is the expert weights the layer applied to it
(SAME: its top-k combine; MoELoRA: the mean over its tokens of the per-token weights) [I].
``router_drift`` is the mean total-variation distance ``½‖p₀ − p_T‖₁`` over texts and layers;
``route_stability`` the mean over layers of :func:`moelab.analysis.route_stability` (the
fraction of texts whose heaviest expert is unchanged) on the two routing records.
"""

from __future__ import annotations

import math
import zlib
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moelab.analysis.consistency import route_stability
from moelab.errors import InvalidValueError
from moelab.methods.continual.domains import DOMAIN_SPECS
from moelab.methods.continual.learner import Learner
from moelab.methods.continual.loop import StreamResult, evaluate_task
from moelab.methods.continual.metrics import accuracy_curve
from moelab.methods.continual.same_layer import SAMELinear
from moelab.methods.continual.task_prior import TaskPrior
from moelab.models.adapters.bilinear_lora import BilinearMoELoRALinear, weights_record
from moelab.models.adapters.lora import LoRALinear
from moelab.models.encoder import pool

_MORE_PARAPHRASES: dict[str, tuple[str, ...]] = {
    "noun": (
        "What kind of thing does this word name?",
        "Name the semantic class of this noun.",
        "To which category of meaning does this word belong?",
    ),
    "fortunes": (
        "What is this quote about?",
        "Name the subject of this saying.",
        "Which theme does this quotation address?",
    ),
    "verb": (
        "What type of event does this verb denote?",
        "Name the semantic class of this verb.",
        "What sort of activity does this verb express?",
    ),
    "kjv": (
        "From which section of the Bible does this verse come?",
        "Name the group of Bible books this verse belongs to.",
        "Where in the Bible is this verse found?",
    ),
    "stdlib": (
        "Name the Python module this code belongs to.",
        "From which standard-library package does this source come?",
        "Which module of Python's standard library contains this code?",
    ),
}
PARAPHRASES: dict[str, tuple[str, ...]] = {
    name: (DOMAIN_SPECS[name].instruction, *more) for name, more in _MORE_PARAPHRASES.items()
}
"""Four instructions per domain: the domain's own (:data:`~moelab.methods.continual.domains.DOMAIN_SPECS`)
and three paraphrases [I]. Other (synthetic) domains use :data:`GENERIC_PARAPHRASES`."""

GENERIC_PARAPHRASES = (
    "Which class is this text?",
    "What is the label of this text?",
    "Name the category of this text.",
    "To which class does this text belong?",
)


def instruction_text(domain: str, text: str) -> str:
    """``"{instruction} [SEP] {text}"`` with the paraphrase ``crc32(text) mod 4`` of the
    domain's instructions [I]."""
    options = PARAPHRASES.get(domain, GENERIC_PARAPHRASES)
    return f"{options[zlib.crc32(text.encode()) % len(options)]} [SEP] {text}"


def _call(layer: nn.Module, x: Tensor, mask: Tensor, prior: Tensor | None) -> Tensor:
    if isinstance(layer, SAMELinear):
        return layer(x, mask, prior)
    return layer(x)


def warmup_cosine(step: int, total: int, warmup: float) -> float:
    """The lr factor at ``step`` of ``total``: linear warm-up over ``ceil(warmup·total)``
    steps, then cosine to 0 (``transformers.get_cosine_schedule_with_warmup``)."""
    w = math.ceil(warmup * total)
    if step < w:
        return step / max(1, w)
    return 0.5 * (1.0 + math.cos(math.pi * (step - w) / max(1, total - w)))


class InstructionLearner(Learner):
    """The shared instruction-tuning loop (module docstring); subclasses build the layers.

    ``model["layers"][b]`` holds block ``start_block + b``'s ``[up, down]`` adapters.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = self.config.same
        stream = self.stream
        domain = [stream.class_names[y].split(":", 1)[0] for y in stream.labels]
        self.inputs = [instruction_text(d, t) for d, t in zip(domain, stream.texts, strict=True)]
        self.cache.add(self.inputs)
        answers = [self.settings.answer_template.format(p) for p in stream.prompts]
        with torch.no_grad():
            self.answers = self.encoder.encode(answers, self.cache.tokenizer)  # [C, D], unit
        self.model["layers"] = nn.ModuleList(
            nn.ModuleList([self.make_layer(b.ffn.up), self.make_layer(b.ffn.down)])
            for b in self.encoder.blocks[self.start_block :]
        )
        self._frozen_inputs: dict[str, Tensor] = {}
        self.routing_snapshots: dict[tuple[str, int], list[Tensor]] = {}

    @abstractmethod
    def make_layer(self, base: nn.Linear) -> nn.Module:
        """The adapter on one FFN linear."""

    # -- forward ----------------------------------------------------------------------------
    def encode_inputs(self, indices: Sequence[int], prior: Tensor | None = None) -> Tensor:
        """Mean-pooled adapted features ``[B, D]`` of the instruction texts of ``indices``."""
        h, mask = self.cache.batch([self.inputs[i] for i in indices])
        bias = torch.zeros(mask.shape, dtype=h.dtype)
        bias.masked_fill_(~mask, torch.finfo(h.dtype).min)
        bias = bias[:, None, None, :]
        for block, (up, down) in zip(
            self.encoder.blocks[self.start_block :], self.model["layers"], strict=True
        ):
            a = block.attn_norm(h + block.attn(h, bias))
            y = _call(down, F.gelu(_call(up, a, mask, prior)), mask, prior)
            h = block.ffn_norm(a + y)
        self._last_mask = mask
        return pool(h, mask)

    def frozen_inputs(self, indices: Sequence[int]) -> Tensor:
        """The frozen encoder's embeddings ``[B, D]`` of the instruction texts (memoized)."""
        texts = [self.inputs[i] for i in indices]
        missing = [t for t in dict.fromkeys(texts) if t not in self._frozen_inputs]
        if missing:
            h, mask = self.cache.batch(missing)
            with torch.no_grad():
                out = self.encoder.forward_from(h, mask, start_block=self.start_block)
            for t, row in zip(missing, pool(out, mask), strict=True):
                self._frozen_inputs[t] = row
        return torch.stack([self._frozen_inputs[t] for t in texts])

    def prior_of(self, indices: Sequence[int]) -> Tensor | None:
        """π for ``indices`` (None: no prior, the default)."""
        return None

    def scores(self, feats: Tensor) -> Tensor:
        return self.settings.logit_scale * F.linear(F.normalize(feats, dim=-1), self.answers)

    def logits(self, indices: Sequence[int]) -> Tensor:
        self.model.eval()
        return self.scores(self.encode_inputs(indices, self.prior_of(indices)))

    # -- training ---------------------------------------------------------------------------
    def begin_task(self, t: int) -> None:
        """Called before training task ``t``."""

    def end_task(self, t: int) -> None:
        """Called after training task ``t``."""

    def learn(self, t: int) -> None:
        s = self.settings
        self.begin_task(t)
        train = self.stream.tasks[t].train
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
        total = s.epochs * math.ceil(len(train) / self.config.batch_size)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: warmup_cosine(k, total, s.warmup))
        self.model.train()
        for _ in range(s.epochs):
            for idx in self.shuffled_batches(train):
                loss = F.cross_entropy(self.scores(self.encode_inputs(idx)), self.labels(idx))
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        self.model.eval()
        self.end_task(t)
        self.tasks_learned = t + 1
        if t == 0 or t == self.stream.num_tasks - 1:
            self.snapshot_routing(t)

    # -- routing telemetry ------------------------------------------------------------------
    def moe_layers(self) -> list[BilinearMoELoRALinear]:
        return [m for m in self.model["layers"].modules() if isinstance(m, BilinearMoELoRALinear)]

    def routing_of(self, indices: Sequence[int], batch: int = 64) -> list[Tensor]:
        """Per MoE layer, the routing ``[N, E]`` of each text (module docstring)."""
        layers = self.moe_layers()
        rows: list[list[Tensor]] = [[] for _ in layers]
        idx = list(indices)
        self.model.eval()
        with torch.no_grad():
            for s in range(0, len(idx), batch):
                part = idx[s : s + batch]
                self.encode_inputs(part, self.prior_of(part))
                m = self._last_mask.unsqueeze(-1).float()
                for k, layer in enumerate(layers):
                    w = layer.last_weights
                    rows[k].append(w if w.dim() == 2 else (w * m).sum(1) / m.sum(1))
        return [torch.cat(r) for r in rows]

    def snapshot_routing(self, t: int, variant: str = "") -> None:
        if self.moe_layers():
            self.routing_snapshots[(variant, t)] = self.routing_of(self.stream.tasks[0].test)

    def drift_metrics(self, variant: str = "") -> dict[str, float]:
        """``router_drift`` and ``route_stability`` between task 0's routing after task 0 and
        after the last task (empty before then, or without MoE layers)."""
        last = self.stream.num_tasks - 1
        a = self.routing_snapshots.get((variant, 0))
        b = self.routing_snapshots.get((variant, last))
        if a is None or b is None or last == 0:
            return {}
        tv = [0.5 * (p - q).abs().sum(-1).mean() for p, q in zip(a, b, strict=True)]
        stab = [
            route_stability(weights_record(p), weights_record(q)).fraction
            for p, q in zip(a, b, strict=True)
        ]
        return {"router_drift": float(np.mean(tv)), "route_stability": float(np.mean(stab))}

    def stream_metrics(self) -> dict[str, float]:
        """The method's own metrics, added to the run's (router drift)."""
        return self.drift_metrics()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """The adapters' state without the frozen encoder weights they wrap."""
        return {k: v for k, v in super().state_dict().items() if ".base." not in k}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if ".base." not in k]
        if missing or unexpected:
            raise RuntimeError(f"state does not fit: missing {missing}, unexpected {unexpected}")

    def grow_to(self, tasks: int) -> None:
        """Nothing grows: every expert exists from the start."""


class SeqLoRALearner(InstructionLearner):
    """Sequential LoRA (rank r, α) on every target, trained task after task."""

    def make_layer(self, base: nn.Linear) -> nn.Module:
        s = self.settings
        return LoRALinear(base, s.rank, s.alpha, s.lora_dropout)


class MoELoRALearner(InstructionLearner):
    """MoELoRA: per-token softmax routing, bilinear A/B coupling, E = one per task [C]."""

    def make_layer(self, base: nn.Linear) -> nn.Module:
        s = self.settings
        E = s.num_experts or self.stream.num_tasks
        return BilinearMoELoRALinear(base, E, s.rank, s.alpha, s.lora_dropout, s.init_std)


class SAMELearner(InstructionLearner):
    """SAME (module docstring); ``model["prior"]`` is the task prior.

    Attributes:
        R_noprior: ``[T, T]`` accuracies (%) of the same weights with π uniform.

    Raises:
        InvalidValueError: the prior with a number of experts other than the task count.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s, T = self.settings, self.stream.num_tasks
        E = s.num_experts or T
        if s.prior and E != T:
            raise InvalidValueError(
                f"same.num_experts: the task prior needs one expert per task ({T}), got {E}"
            )
        self.model["prior"] = TaskPrior(
            T, self.encoder.cfg.hidden_size, s.prior_scale, s.prior_text_weight
        )
        self.use_prior = s.prior
        self.R_noprior = np.full((T, T), np.nan)

    def make_layer(self, base: nn.Linear) -> nn.Module:
        s = self.settings
        return SAMELinear(base, s.num_experts or self.stream.num_tasks, s)

    def same_layers(self) -> list[SAMELinear]:
        return [m for m in self.model["layers"].modules() if isinstance(m, SAMELinear)]

    def begin_task(self, t: int) -> None:
        for layer in self.same_layers():
            layer.begin_task(t)
        train = list(self.stream.tasks[t].train)
        for s in range(0, len(train), 64):
            part = train[s : s + 64]
            self.model["prior"].update(t, self.frozen_inputs(part), self.frozen_features(part))

    def end_task(self, t: int) -> None:
        for layer in self.same_layers():
            layer.end_task()

    def prior_of(self, indices: Sequence[int]) -> Tensor | None:
        if not self.use_prior:
            return None
        return self.model["prior"](self.frozen_inputs(indices), self.frozen_features(indices))

    def learn(self, t: int) -> None:
        super().learn(t)
        if not self.settings.prior:
            return
        # the ablation: the same weights, routed without the prior
        self.use_prior = False
        try:
            for j in self.stream.tested(t):
                correct, total = evaluate_task(self, t, j)
                self.R_noprior[t, j] = 100.0 * correct / total
            if t == 0 or t == self.stream.num_tasks - 1:
                self.snapshot_routing(t, "noprior")
        finally:
            self.use_prior = True

    def stream_metrics(self) -> dict[str, float]:
        out = self.drift_metrics()
        n = self.tasks_learned
        if self.settings.prior and n:
            sizes = [len(self.stream.tasks[j].test) for j in range(n)]
            R = self.R_noprior[:n, :n]
            ablation = StreamResult(R.copy(), accuracy_curve(R, sizes)).metrics()
            ablation.update(self.drift_metrics("noprior"))
            out.update({f"noprior_{k}": v for k, v in ablation.items()})
        return out


__all__ = [
    "PARAPHRASES",
    "InstructionLearner",
    "MoELoRALearner",
    "SAMELearner",
    "SeqLoRALearner",
    "instruction_text",
    "warmup_cosine",
]
