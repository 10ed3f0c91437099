"""GiGPO/GRPO/GAE advantages and the PPO loss against hand-computed values."""

import math

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.rl.advantages import (
    discounted_returns,
    gae_advantages,
    gigpo_advantages,
    group_normalise,
)
from moelab.methods.rl.ppo import k3_kl, ppo_clip_loss

# group 0: episode 0 (3 steps, reward 1 at the end), episode 1 (2 steps, reward 0.5);
# group 1: episode 2 alone (2 steps, reward 0). Anchors: both first steps share anchor 0, both
# second steps anchor 1; episode 0's last step and episode 2's steps are singletons.
REWARDS = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.5, 0.0, 0.0])
EPISODE = torch.tensor([0, 0, 0, 1, 1, 2, 2])
GROUP = torch.tensor([0, 0, 1])
ANCHOR = torch.tensor([0, 1, 2, 0, 1, 3, 4])


def test_discounted_returns():
    g = discounted_returns(REWARDS, EPISODE, 0.9)
    torch.testing.assert_close(g, torch.tensor([0.81, 0.9, 1.0, 0.45, 0.5, 0.0, 0.0]))


def test_gigpo_mean_std_by_hand():
    # A^E: returns (1, 0.5) → mean 0.75, unbiased std 0.25·√2 → ±1/√2; episode 2 alone: R = 0
    # A^S: anchor 0 holds (0.81, 0.45), anchor 1 (0.9, 0.5) → ±1/√2 each; singletons → 0
    a = gigpo_advantages(REWARDS, EPISODE, GROUP, ANCHOR, gamma=0.9, step_weight=1.0)
    r = 1 / math.sqrt(2)
    expected = torch.tensor([2 * r, 2 * r, r, -2 * r, -2 * r, 0.0, 0.0])
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=0)


def test_gigpo_mean_norm_and_grpo_by_hand():
    a = gigpo_advantages(REWARDS, EPISODE, GROUP, ANCHOR, gamma=0.9, norm="mean")
    torch.testing.assert_close(a, torch.tensor([0.43, 0.45, 0.25, -0.43, -0.45, 0.0, 0.0]))
    grpo = gigpo_advantages(REWARDS, EPISODE, GROUP, ANCHOR, step_weight=0.0, norm="mean")
    torch.testing.assert_close(grpo, torch.tensor([0.25, 0.25, 0.25, -0.25, -0.25, 0.0, 0.0]))


def test_singleton_groups_follow_verl():
    v = torch.tensor([3.0, 1.0, 2.0])
    g = torch.tensor([7, 8, 8])
    # episode groups: a singleton keeps its value; step groups: a singleton gives 0
    out = group_normalise(v, g, "mean_std", singleton_mean=False)
    torch.testing.assert_close(out[0], torch.tensor(3.0))
    out = group_normalise(v, g, "mean_std", singleton_mean=True)
    torch.testing.assert_close(out[0], torch.tensor(0.0))
    std = torch.tensor([1.0, 2.0]).std()
    torch.testing.assert_close(out[1:], torch.tensor([-0.5, 0.5]) / (std + 1e-6))


def test_gae_by_hand():
    rewards = torch.tensor([0.0, 1.0, 0.0])
    values = torch.tensor([0.5, 0.5, 0.2])
    episode = torch.tensor([0, 0, 1])
    terminal = torch.tensor([False, True, False])
    adv, ret = gae_advantages(rewards, values, episode, terminal, 0.9, 0.8)
    # δ1 = 1 − 0.5; δ0 = 0.9·0.5 − 0.5 = −0.05, A0 = −0.05 + 0.72·0.5; episode 1: −0.2
    torch.testing.assert_close(adv, torch.tensor([0.31, 0.5, -0.2]))
    torch.testing.assert_close(ret, adv + values)


def test_ppo_loss_on_a_fixed_batch():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.75, 0.25, 0.5]))  # ratios 1.5, 0.5, 1.0
    adv = torch.tensor([1.0, 1.0, -1.0])
    # min(1.5, 1.2) = 1.2; min(0.5, 0.8) = 0.5; −1 → loss −(1.2 + 0.5 − 1)/3
    assert ppo_clip_loss(new, old, adv, 0.2).item() == pytest.approx(-0.7 / 3)
    # k3 with log π_ref − log π = log 2: 2 − log 2 − 1
    kl = k3_kl(torch.log(torch.tensor([0.25])), torch.log(torch.tensor([0.5])))
    assert kl.item() == pytest.approx(1 - math.log(2))
    assert k3_kl(new, new).item() == 0.0


def test_bad_inputs_raise():
    with pytest.raises(InvalidValueError, match="norm"):
        group_normalise(
            torch.zeros(2), torch.zeros(2, dtype=torch.long), "std", singleton_mean=True
        )
    with pytest.raises(InvalidValueError, match="episode"):
        gigpo_advantages(REWARDS, EPISODE, GROUP[:2], ANCHOR)
    with pytest.raises(InvalidValueError, match="rewards, episode, anchor"):
        gigpo_advantages(REWARDS, EPISODE[:3], GROUP, ANCHOR)
