"""The PA-MoE recipe for :func:`moelab.methods.runner.run_seeds`: one arm, one seed, metrics.

Arms are :class:`~moelab.methods.rl.config.RLConfig` variants (``arm``, ``estimator``).
"""

from __future__ import annotations

from pathlib import Path

from moelab.methods.rl.config import RLConfig
from moelab.methods.rl.train import run_metrics, train_policy


class PAMoERecipe:
    """``run(config, seed) -> metrics`` (:func:`~moelab.methods.rl.train.run_metrics`).

    Args:
        checkpoint_dir: keep a resumable checkpoint per arm and seed there
            (``<arm>-<estimator>-seed<seed>.pt``); a rerun resumes each from its file.
        progress: show a progress bar per run.
    """

    name = "pa-moe"

    def __init__(self, checkpoint_dir: str | Path | None = None, progress: bool = False) -> None:
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.progress = progress

    def checkpoint(self, config: RLConfig, seed: int) -> Path | None:
        """The checkpoint file of this arm and seed (None without ``checkpoint_dir``)."""
        if self.checkpoint_dir is None:
            return None
        return self.checkpoint_dir / f"{config.arm}-{config.estimator}-seed{seed}.pt"

    def run(self, config: RLConfig, seed: int) -> dict[str, float]:
        ckpt = self.checkpoint(config, seed)
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
        return run_metrics(train_policy(config, seed, checkpoint=ckpt, progress=self.progress))
