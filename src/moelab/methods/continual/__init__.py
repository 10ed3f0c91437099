"""Continual learning on a frozen pretrained encoder: the shared harness (streams, the accuracy
matrix and its metrics, heads, classifier alignment, a per-class reservoir, the cached
backbone) and its methods: CaRE (bi-level routing MoE adapters) with the SimpleCIL, APER and
sequential fine-tuning baselines; CKA-guided selective upcycling with full upcycling and
sequential fine-tuning with replay (:mod:`~moelab.methods.continual.upcycling`); SAME
(stabilised bilinear MoE-LoRA for continual instruction tuning) with the MoELoRA and
sequential LoRA baselines; MoRAM (self-routed rank-1 atoms, :mod:`.moram`) with the
zero-shot, MoE-LoRA and sequential-LoRA label-prompt baselines (:mod:`.prompt`).

Later continual methods (MoRAM) plug in as a new
:class:`~moelab.methods.continual.learner.Learner` subclass (``learn(t)``, ``logits``) on the
same :class:`~moelab.methods.continual.stream.Stream` (class-, task- or domain-incremental;
the five real text domains of :mod:`~moelab.methods.continual.domains` for the latter two),
:class:`~moelab.methods.continual.backbone.PrefixCache` and
:func:`~moelab.methods.continual.loop.run_stream`.
"""

from moelab.methods.continual.brmoe import BRMoE, BRMoESide
from moelab.methods.continual.care import CaRELearner
from moelab.methods.continual.config import METHODS, ContinualConfig
from moelab.methods.continual.domains import TextDomain, load_text_domains, synthetic_domains
from moelab.methods.continual.loop import StreamResult, router_hit_rate, run_stream
from moelab.methods.continual.moram import MoRAMLearner
from moelab.methods.continual.moram_config import MoRAMSettings
from moelab.methods.continual.recipe import LEARNERS, ContinualRecipe
from moelab.methods.continual.same import MoELoRALearner, SAMELearner, SeqLoRALearner
from moelab.methods.continual.same_layer import SAMELinear
from moelab.methods.continual.same_settings import SAMESettings
from moelab.methods.continual.stream import (
    Stream,
    Task,
    class_incremental_stream,
    domain_incremental_stream,
)
from moelab.methods.continual.task_prior import TaskPrior
from moelab.methods.continual.upcycling import (
    FullUpcyclingLearner,
    SelectiveUpcyclingLearner,
    SeqFTReplayLearner,
    UpcyclingLearner,
)
from moelab.methods.continual.upcycling_settings import UpcyclingSettings

__all__ = [
    "LEARNERS",
    "METHODS",
    "BRMoE",
    "BRMoESide",
    "CaRELearner",
    "ContinualConfig",
    "ContinualRecipe",
    "FullUpcyclingLearner",
    "MoELoRALearner",
    "MoRAMLearner",
    "MoRAMSettings",
    "SAMELearner",
    "SAMELinear",
    "SAMESettings",
    "SelectiveUpcyclingLearner",
    "SeqFTReplayLearner",
    "SeqLoRALearner",
    "Stream",
    "StreamResult",
    "Task",
    "TaskPrior",
    "TextDomain",
    "UpcyclingLearner",
    "UpcyclingSettings",
    "class_incremental_stream",
    "domain_incremental_stream",
    "load_text_domains",
    "router_hit_rate",
    "run_stream",
    "synthetic_domains",
]
