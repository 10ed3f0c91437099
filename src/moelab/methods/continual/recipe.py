"""The continual-learning recipe for :func:`moelab.methods.runner.run_seeds`: one method on one
stream for one seed → Ā, last accuracy, forgetting, BWT (and CaRE's router hit rate).

The recipe keeps, across runs, the encoder, the labelled data and the prefix cache (keyed by
text, so every arm and seed reuses what was computed), and per ``(method, seed)`` the last
run's :class:`~moelab.methods.continual.loop.StreamResult` in :attr:`ContinualRecipe.history`
(the accuracy curves the benchmark plots).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from moelab.errors import InvalidValueError
from moelab.methods.continual.backbone import PrefixCache, check_adapted_blocks
from moelab.methods.continual.baselines import APERLearner, FinetuneLearner, SimpleCILLearner
from moelab.methods.continual.care import CaRELearner
from moelab.methods.continual.config import DOMAIN_STREAMS, INSTRUCTION_METHODS, ContinualConfig
from moelab.methods.continual.data import load_stream_data
from moelab.methods.continual.domains import domain_stream, load_text_domains, synthetic_domains
from moelab.methods.continual.learner import Learner
from moelab.methods.continual.loop import StreamResult, router_hit_rate, run_stream
from moelab.methods.continual.moram import MoRAMLearner
from moelab.methods.continual.prompt import (
    PromptMoELoRALearner,
    PromptSeqLoRALearner,
    ZeroShotLearner,
)
from moelab.methods.continual.report import plot_curves, stream_extra
from moelab.methods.continual.same import MoELoRALearner, SAMELearner, SeqLoRALearner
from moelab.methods.continual.stream import Stream, class_incremental_stream
from moelab.methods.continual.upcycling import LEARNERS as UPCYCLING_LEARNERS
from moelab.methods.continual.upcycling import UpcyclingLearner
from moelab.methods.runner import run_seeds
from moelab.models.encoder import BertEncoder, Tokenize
from moelab.utils.results import BenchmarkResult, write_result

LEARNERS: dict[str, type[Learner]] = {
    "care": CaRELearner,
    "simplecil": SimpleCILLearner,
    "aper": APERLearner,
    "finetune": FinetuneLearner,
    **UPCYCLING_LEARNERS,
    "same": SAMELearner,
    "moelora": MoELoRALearner,
    "seqlora": SeqLoRALearner,
    "moram": MoRAMLearner,
    "prompt-moe-lora": PromptMoELoRALearner,
    "prompt-seq-lora": PromptSeqLoRALearner,
    "zeroshot": ZeroShotLearner,
}


class ContinualRecipe:
    """``run(config, seed) -> metrics``.

    Args:
        encoder, tokenizer: the backbone (default: ``load_pretrained("minilm")`` with
            ``config.max_tokens`` tokens per text); tests pass a tiny one.
        progress: called as ``progress(method, seed, task, num_tasks, A_t)`` after each task.
    """

    name = "care"

    def __init__(
        self,
        encoder: BertEncoder | None = None,
        tokenizer: Tokenize | None = None,
        progress: Callable[[str, int, int, int, float], None] | None = None,
    ) -> None:
        self._backbone = None if encoder is None else (encoder, tokenizer)
        self._data: dict[tuple, object] = {}
        self._caches: dict[tuple, PrefixCache] = {}
        self.progress = progress
        self.history: dict[tuple[str, int], StreamResult] = {}
        self.seconds: dict[tuple[str, int], float] = {}
        self.details: dict[tuple[str, int], dict] = {}  # the upcycling arms' growth and CKA
        self.atom_usage: dict[tuple[str, int], dict[str, dict[str, float]]] = {}

    def backbone(self, config: ContinualConfig) -> tuple[BertEncoder, Tokenize]:
        if self._backbone is None:
            from moelab.interop.pretrained import load_pretrained

            self._backbone = load_pretrained("minilm", max_seq_len=config.max_tokens)
        return self._backbone

    def stream(self, config: ContinualConfig, seed: int) -> Stream:
        per_class = config.train_per_class + config.test_per_class
        if config.stream in DOMAIN_STREAMS:
            key = (config.stream, per_class)
            if key not in self._data:
                self._data = {
                    key: load_text_domains()
                    if config.stream == "domains"
                    else synthetic_domains(3, 4, per_class)
                }
            return domain_stream(
                self._data[key],
                train_per_class=config.train_per_class,
                test_per_class=config.test_per_class,
                seed=seed,
                scenario=config.scenario,
            )
        key = (config.stream, config.num_classes, per_class)
        if key not in self._data:
            self._data = {key: load_stream_data(*key)}
        return class_incremental_stream(
            self._data[key],
            num_tasks=config.num_tasks,
            classes_per_task=config.classes_per_task,
            train_per_class=config.train_per_class,
            test_per_class=config.test_per_class,
            seed=seed,
            scenario=config.scenario,
        )

    def learner(self, config: ContinualConfig, seed: int) -> Learner:
        """A fresh learner of ``config.method`` on the seed's stream, its texts cached."""
        encoder, tokenizer = self.backbone(config)
        start = check_adapted_blocks(encoder, config.adapted_blocks)
        stream = self.stream(config, seed)
        key = (start, config.max_tokens)
        if key not in self._caches:
            self._caches[key] = PrefixCache(encoder, tokenizer, start)
        cache = self._caches[key]
        cache.add(stream.texts)
        return LEARNERS[config.method](config, stream, encoder, cache, seed)

    def run(self, config: ContinualConfig, seed: int) -> dict[str, float]:
        learner = self.learner(config, seed)
        T = learner.stream.num_tasks
        t0 = time.perf_counter()

        def report(t: int, acc: float) -> None:
            if self.progress is not None:
                self.progress(config.method, seed, t, T, acc)

        result = run_stream(learner, progress=report)
        self.seconds[(config.method, seed)] = time.perf_counter() - t0
        self.history[(config.method, seed)] = result
        metrics = result.metrics()
        if config.method == "care" and config.scenario == "class":
            metrics["router_hit_rate"] = router_hit_rate(learner)
        if isinstance(learner, UpcyclingLearner):
            metrics.update(learner.growth_metrics())
            self.details[(config.method, seed)] = learner.details()
        if config.method in INSTRUCTION_METHODS:
            metrics.update(learner.stream_metrics())
        if config.method == "moram":
            self.atom_usage[(config.method, seed)] = usage = learner.atom_usage()
            metrics.update({f"atoms_{k}": v for k, v in usage["all"].items()})
        return metrics


def run_methods(
    config: ContinualConfig,
    methods: list[str],
    seeds: list[int],
    *,
    recipe: ContinualRecipe | None = None,
    out: str | os.PathLike[str] | None = None,
) -> BenchmarkResult:
    """Run every method (``methods[0]`` first, paired against the others) for every seed on
    ``config``'s stream; the result's ``extra["streams"][method][seed]`` holds each run's
    accuracy curve and per-task accuracies (:func:`~moelab.methods.continual.report.stream_extra`).
    With ``out`` the result JSON is written there and the accuracy plot beside it (same
    name, ``.png``).

    Raises:
        InvalidValueError: an unknown or repeated method; see
            :func:`~moelab.methods.runner.run_seeds`.
    """
    bad = [m for m in methods if m not in LEARNERS]
    if bad or not methods or len(set(methods)) != len(methods):
        raise InvalidValueError(
            f"methods: must be distinct names among {', '.join(LEARNERS)}, got {methods!r}"
        )
    recipe = recipe or ContinualRecipe()
    result = run_seeds(recipe, config, seeds, arms={m: {"method": m} for m in methods})
    result.extra["streams"] = {
        m: {str(s): stream_extra(recipe.history[(m, s)]) for s in seeds} for m in methods
    }
    if out is not None:
        write_result(result, out)
        curves = {m: {s: recipe.history[(m, s)].curve.tolist() for s in seeds} for m in methods}
        title = (
            f"{config.stream}, {config.scenario} scenario"
            if config.stream in DOMAIN_STREAMS
            else f"{config.stream}, {config.num_tasks} tasks of {config.classes_per_task} classes"
        )
        plot_curves(curves, Path(out).with_suffix(".png"), title)
    return result
