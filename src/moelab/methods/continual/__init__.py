"""Continual learning on a frozen pretrained encoder: the shared harness (streams, the accuracy
matrix and its metrics, heads, classifier alignment, a per-class reservoir, the cached
backbone) and its methods: CaRE (bi-level routing MoE adapters) with the SimpleCIL, APER and
sequential fine-tuning baselines; MoRAM (self-routed rank-1 atoms, :mod:`.moram`) with the
zero-shot, MoE-LoRA and sequential-LoRA label-prompt baselines (:mod:`.prompt`).

Later continual methods (MoRAM, SAME, CKA-guided upcycling) plug in as a new
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
from moelab.methods.continual.stream import (
    Stream,
    Task,
    class_incremental_stream,
    domain_incremental_stream,
)

__all__ = [
    "LEARNERS",
    "METHODS",
    "BRMoE",
    "BRMoESide",
    "CaRELearner",
    "ContinualConfig",
    "ContinualRecipe",
    "MoRAMLearner",
    "MoRAMSettings",
    "Stream",
    "StreamResult",
    "Task",
    "TextDomain",
    "class_incremental_stream",
    "domain_incremental_stream",
    "load_text_domains",
    "router_hit_rate",
    "run_stream",
    "synthetic_domains",
]
