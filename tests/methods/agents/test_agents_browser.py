"""The MiniWoB++ generator regenerates a small sample; the oracle's chain replays online."""

import pytest

from moelab.methods.agents.browser import browser_missing, miniwob_env, run_policy
from moelab.methods.agents.chain import read_chains

REASON = browser_missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.mark.slow
def test_regenerated_sample_equals_the_shipped_chains():
    from moelab.methods.agents.browser import generate_chains

    tasks = ("login-user", "click-checkboxes")
    fresh = generate_chains(tasks, range(2))
    shipped = [s for s in read_chains() if s.task in tasks and s.seed < 2]
    assert fresh == shipped


@pytest.mark.slow
def test_replaying_the_gold_chains_solves_the_episode():
    gold = [s for s in read_chains() if s.task == "enter-password" and s.seed == 3]
    replies = iter(s.target for s in gold)
    with miniwob_env("enter-password") as env:
        result = run_policy(env, "enter-password", 3, lambda prompts: [next(replies)])
    assert result.success and result.steps == len(gold)
