"""PA-MoE: a phase-aware Mixture-of-Experts policy for agentic RL, on MiniGrid.

Paper: Yang, Li, He, Li, Cai, Jiang, Feng, "Phase-Aware Mixture of Experts for Agentic
Reinforcement Learning", ICML 2026, arXiv 2602.17038 (METHODS.md #6); code: YsTvT/PA-MoE.
The released training script does not run PA-MoE (one LoRA, the router never called, a
gradient-free switching penalty, no diversity loss; ``shared/research/wave3-agents-alignment.md``
§1.2), so this is written from the method's description, not ported.

* the phase router (:mod:`moelab.core.routers.phase`): observation ⊗ goal attention plus an
  LSTM over the last steps' features → expert logits, τ annealed 2.0 → 0.5, sampled in training,
  argmax in evaluation; one expert per environment step, handed to the MoE head as a
  :class:`~moelab.core.plan.RoutingPlan` [C architecture, sizes I];
* its objective (:mod:`moelab.core.losses.phase`): REINFORCE on the step advantage minus a
  switching cost (the code's intended penalty, made to act [I]), the ``Σ(f̄ − 1/E)²`` balance
  loss and the diversity loss [C];
* the policy update: PPO-clip on GiGPO advantages (episode + anchor-state groups), k3 KL to the
  initial policy, no critic [C]; GRPO and PPO with GAE as alternatives;
* arms: single policy (equal total parameters), step-level token-choice MoE, trajectory-level
  routing, PA-MoE (:mod:`.policy`).

This project's reading [I]: MiniGrid instead of ALFWorld/WebShop (75 % Empty-Random-5x5,
25 % DoorKey-5x5), a small trainable trunk instead of a frozen LLM, GELU experts beside a shared
expert instead of LoRA adapters, the router reading detached embeddings and stored history.

Entry points: :class:`~moelab.methods.rl.recipe.PAMoERecipe` (for
:func:`moelab.methods.runner.run_seeds`), :func:`~moelab.methods.rl.train.train_policy`,
:func:`~moelab.methods.rl.train.evaluate`; ``moelab rl train``; ``benchmarks/pa_moe.py``.
"""

from moelab.methods.rl.config import ARMS, RLConfig
from moelab.methods.rl.recipe import PAMoERecipe
from moelab.methods.rl.train import RLRun, evaluate, run_metrics, train_policy

__all__ = ["ARMS", "PAMoERecipe", "RLConfig", "RLRun", "evaluate", "run_metrics", "train_policy"]
