"""Online evaluation: the trained agent acts in MiniWoB++ on held-out episodes."""

from __future__ import annotations

from collections import defaultdict

from moelab.methods.agents.browser import miniwob_env, run_policy
from moelab.methods.agents.data import AgentData
from moelab.methods.agents.evaluate import generate_chains
from moelab.methods.agents.tokens import fit_prompt
from moelab.models import MoETransformer

MAX_NEW = 96


def agent_policy(model: MoETransformer, data: AgentData):
    """A policy for :func:`~moelab.methods.agents.browser.run_policy`: prompts → greedy chain
    text (prompts cut as in training, leaving room for the chain)."""
    room = model.cfg.max_seq_len - MAX_NEW

    def policy(prompts: list[str]) -> list[str]:
        ids = [fit_prompt(data.tokenizer.encode(p), room) for p in prompts]
        outs = generate_chains(model, ids, data.eot_id, max_tokens=MAX_NEW)
        return [data.tokenizer.decode(o) for o in outs]

    return policy


def evaluate_online(run, episodes: int) -> dict[str, float]:
    """Task success of ``run`` (an :class:`~moelab.methods.agents.recipe.AgentRun`) on the
    first ``episodes`` held-out seeds of each task: ``online_success`` (mean over tasks) and
    ``online/<task>``.

    Raises:
        MissingDependencyError: no browser (see :func:`~.browser.browser_missing`).
    """
    data: AgentData = run.data
    seeds: dict[str, list[int]] = defaultdict(list)
    for s in data.test_steps:
        if s.seed not in seeds[s.task]:
            seeds[s.task].append(s.seed)
    policy = agent_policy(run.model, data)
    out = {}
    for task in seeds:
        chosen = sorted(seeds[task])[:episodes]
        with miniwob_env(task) as env:
            wins = [run_policy(env, task, seed, policy).success for seed in chosen]
        out[f"online/{task}"] = sum(wins) / len(wins)
    out["online_success"] = sum(out.values()) / len(out)
    return out
