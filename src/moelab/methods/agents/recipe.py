"""The CoME recipe for :func:`moelab.methods.runner.run_seeds`: one arm, one seed, metrics.

Arms are :class:`~moelab.methods.agents.config.ComeConfig` variants (``arm``, ``dpo``). The
recipe keeps the data (split and tokenizer) and the current seed's dense warm-up model, so every
arm of a seed starts from the same warm-up, as the spec has it.
"""

from __future__ import annotations

import dataclasses
import time

from moelab.methods.agents.browser import browser_missing
from moelab.methods.agents.chain import ChainStep
from moelab.methods.agents.config import ComeConfig
from moelab.methods.agents.data import AgentData, prepare_data
from moelab.methods.agents.dpo import build_pairs, train_dpo, train_reward_model
from moelab.methods.agents.evaluate import evaluate_offline
from moelab.methods.agents.online import evaluate_online
from moelab.methods.agents.train import train_arm, warm_up
from moelab.models import MoETransformer

# the fields the data and the warm-up depend on (besides the seed)
_DATA_FIELDS = ("data_path", "tasks", "test_episodes", "train_episodes", "vocab_size", "max_len")
_WARM_FIELDS = (
    *_DATA_FIELDS,
    "d_model",
    "n_layers",
    "n_heads",
    "ffn_size",
    "warmup_steps",
    "batch_size",
    "lr",
    "grad_clip",
)


def _key(config: ComeConfig, fields: tuple[str, ...], *extra: object) -> tuple:
    return (*extra, *(getattr(config, f) for f in fields))


@dataclasses.dataclass
class AgentRun:
    """A trained agent: the model, its data (tokenizer, splits) and the config."""

    model: MoETransformer
    data: AgentData
    config: ComeConfig


class ComeRecipe:
    """``run(config, seed) -> metrics`` (see :mod:`moelab.methods.agents.evaluate`; plus
    ``online_success`` when ``online_episodes`` > 0 and a browser exists, and ``dpo_pairs``
    with DPO).

    Args:
        steps: chain steps to use instead of reading ``config.data_path`` (tests).
    """

    name = "come"

    def __init__(self, steps: list[ChainStep] | None = None) -> None:
        self._steps = steps
        self._data: dict[tuple, AgentData] = {}
        self._warm: dict[tuple, MoETransformer] = {}

    def data(self, config: ComeConfig) -> AgentData:
        """The split and tokenised chains of ``config`` (cached)."""
        key = _key(config, _DATA_FIELDS)
        if key not in self._data:
            self._data = {key: prepare_data(config, self._steps)}
        return self._data[key]

    def train(self, config: ComeConfig, seed: int) -> tuple[AgentRun, dict[str, float]]:
        """Train one arm (warm-up cached per seed); the run and its training figures."""
        data = self.data(config)
        key = _key(config, _WARM_FIELDS, seed)
        t0 = time.perf_counter()
        if key not in self._warm:
            self._warm = {key: warm_up(config, data, seed)}
        model = train_arm(config, data, self._warm[key], seed)
        extra = {"train_seconds": time.perf_counter() - t0}
        if config.dpo != "none":
            reward = (
                train_reward_model(self._warm[key], data, config, seed)
                if config.dpo == "info"
                else None
            )
            pairs = build_pairs(model, reward, data, config, seed)
            train_dpo(model, pairs, config, seed)
            extra["dpo_pairs"] = float(len(pairs))
        return AgentRun(model, data, config), extra

    def run(self, config: ComeConfig, seed: int) -> dict[str, float]:
        run, metrics = self.train(config, seed)
        metrics.update(evaluate_run(run.model, run.data, config))
        if config.online_episodes and browser_missing() is None:
            metrics.update(evaluate_online(run, config.online_episodes))
        return metrics


def evaluate_run(model: MoETransformer, data: AgentData, config: ComeConfig) -> dict[str, float]:
    """Offline metrics (:func:`~moelab.methods.agents.evaluate.evaluate_offline`) on every
    held-out step, or on ``config.eval_steps`` of them evenly spaced (all tasks represented)."""
    total = len(data.test_steps)
    n = min(config.eval_steps or total, total)
    idx = [i * total // n for i in range(n)]
    steps, chains = [data.test_steps[i] for i in idx], [data.test[i] for i in idx]
    return evaluate_offline(model, data.tokenizer, data.eot_id, steps, chains)
