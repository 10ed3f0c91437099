"""MiniWoB++ in headless Chromium: generate oracle chains and run a policy online.

Needs the optional ``miniwob`` and ``selenium`` packages and a Chromium with its driver
(Debian: ``apt-get install chromium chromium-driver``); ``MINIWOB_CHROME_BINARY`` and
``MINIWOB_CHROMEDRIVER`` are set to the Debian paths when unset and present. Training, tests and
benchmarks read the shipped chains (:func:`moelab.methods.agents.chain.read_chains`) instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from moelab.errors import MissingDependencyError
from moelab.methods.agents.chain import ChainStep, format_prompt, parse_function, parse_target
from moelab.methods.agents.dom import serialise_dom, summarise
from moelab.methods.agents.oracle import OracleError, plan_episode

AGENTS_INSTALL = "pip install 'moelab[agents]' and apt-get install chromium chromium-driver"
_DEBIAN = {"MINIWOB_CHROME_BINARY": "chromium", "MINIWOB_CHROMEDRIVER": "chromedriver"}


def browser_missing() -> str | None:
    """Why the browser path cannot run here (a one-line reason), or None when it can."""
    try:
        import miniwob  # noqa: F401
        import selenium  # noqa: F401
    except ImportError as e:
        return f"the browser path needs {e.name}; install with: {AGENTS_INSTALL}"
    for var, exe in _DEBIAN.items():
        if not (os.environ.get(var) or shutil.which(exe)):
            return f"no {exe} on PATH and {var} unset; install with: {AGENTS_INSTALL}"
    return None


@contextmanager
def miniwob_env(task: str) -> Iterator[object]:
    """A headless MiniWoB++ environment ``miniwob/<task>-v1``, closed on exit.

    Raises:
        MissingDependencyError: miniwob, selenium, chromium or chromedriver is missing.
    """
    reason = browser_missing()
    if reason is not None:
        raise MissingDependencyError(reason)
    for var, exe in _DEBIAN.items():
        os.environ.setdefault(var, shutil.which(exe) or exe)
    import gymnasium
    import miniwob

    gymnasium.register_envs(miniwob)
    env = gymnasium.make(f"miniwob/{task}-v1")
    try:
        yield env
    finally:
        env.close()


def _action(env, ref: int, text: str | None) -> dict:
    from miniwob.action import ActionTypes

    if text is None:
        return env.unwrapped.create_action(ActionTypes.CLICK_ELEMENT, ref=ref)
    return env.unwrapped.create_action(ActionTypes.FOCUS_ELEMENT_AND_TYPE_TEXT, ref=ref, text=text)


def oracle_episode(env, task: str, seed: int) -> list[ChainStep] | None:
    """Run the oracle on one episode; its chain steps if MiniWoB++ rewards it, else None."""
    obs, _ = env.reset(seed=seed)
    try:
        plan = plan_episode(task, obs["fields"], obs["dom_elements"])
    except OracleError:
        return None
    steps, reward, done = [], 0.0, False
    for i, st in enumerate(plan):
        els = obs["dom_elements"]
        steps.append(
            ChainStep(
                task=task,
                seed=seed,
                step=i,
                utterance=obs["utterance"],
                dom=serialise_dom(els),
                summary=summarise(els),
                subtask=st.subtask,
                decision=st.decision,
                function=st.function,
            )
        )
        obs, reward, done, truncated, _ = env.step(_action(env, st.ref, st.text))
        if done or truncated:
            break
    return steps if done and reward > 0 and len(steps) == len(plan) else None


def generate_chains(
    tasks: Iterable[str], seeds: Iterable[int], progress: Callable[[str], None] | None = None
) -> list[ChainStep]:
    """Oracle chains for every (task, seed); unsolved episodes are dropped.

    Raises:
        MissingDependencyError: the browser path is not installed (:func:`browser_missing`).
    """
    seeds = list(seeds)
    out: list[ChainStep] = []
    for task in tasks:
        kept = 0
        with miniwob_env(task) as env:
            for seed in seeds:
                steps = oracle_episode(env, task, seed)
                if steps is not None:
                    out += steps
                    kept += 1
        if progress is not None:
            progress(f"{task}: {kept}/{len(seeds)} episodes solved")
    return out


@dataclass(frozen=True)
class EpisodeResult:
    """One online episode: ``success`` (MiniWoB++ reward > 0) and ``steps`` taken."""

    task: str
    seed: int
    success: bool
    steps: int


def run_policy(
    env, task: str, seed: int, policy: Callable[[list[str]], list[str]], max_steps: int = 8
) -> EpisodeResult:
    """Let ``policy`` act in one episode: each step it gets the prompt
    (:func:`~moelab.methods.agents.chain.format_prompt`) and returns chain text whose action
    function is executed; an unparsable function ends the episode as a failure."""
    obs, _ = env.reset(seed=seed)
    for t in range(max_steps):
        prompt = format_prompt(obs["utterance"], serialise_dom(obs["dom_elements"]))
        fn = parse_function(parse_target(policy([prompt])[0]).get("function", ""))
        if fn is None:
            return EpisodeResult(task, seed, False, t + 1)
        _, ref, text = fn
        obs, reward, done, truncated, _ = env.step(_action(env, ref, text))
        if done or truncated:
            return EpisodeResult(task, seed, reward > 0, t + 1)
    return EpisodeResult(task, seed, False, max_steps)
