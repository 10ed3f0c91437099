"""The RL recipe on MiniGrid: seeded rollouts, metrics, checkpoints, bad input."""

import dataclasses

import pytest
import torch

pytest.importorskip("minigrid")

from moelab.errors import InvalidValueError
from moelab.methods.rl import PAMoERecipe, RLConfig, train_policy
from moelab.methods.rl.envs import EnvPool, TaskMix, make_env
from moelab.methods.rl.io import checkpoint_frames
from moelab.methods.rl.metrics import expert_phase_nmi, expert_shares, switches_per_episode
from moelab.methods.rl.policy import MiniGridPolicy
from moelab.methods.rl.rollout import collect
from moelab.models.io import CheckpointError

TINY = RLConfig(
    max_steps=30,
    frames=300,
    groups=2,
    group_size=2,
    eval_every=150,
    eval_episodes=2,
    final_episodes=3,
    minibatch=128,
    hidden_size=16,
    embed_size=4,
    router_size=8,
    expert_size=4,
    shared_size=8,
)


def _rollout(arm: str, seed: int, slots, greedy=False):
    config = dataclasses.replace(TINY, arm=arm)
    mix = TaskMix.build(config.tasks, config.task_weights, config.max_steps)
    torch.manual_seed(0)
    policy = MiniGridPolicy(config, len(mix.vocab) + 1)
    gen = torch.Generator().manual_seed(seed)
    return collect(
        policy,
        mix,
        EnvPool(mix),
        slots,
        [0, 0, 1],
        history=5,
        greedy=greedy,
        tau=2.0,
        generator=gen,
    )


def test_env_seed_reproduces_a_rollout():
    slots = [(1, 11), (1, 11), (0, 5)]
    a, b = _rollout("pamoe", 3, slots), _rollout("pamoe", 3, slots)
    for name in ("image", "action", "expert", "reward", "anchor", "phase", "logp"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    c = _rollout("pamoe", 4, slots)  # other sampling seed: other actions
    assert not torch.equal(a.action[:20], c.action[:20])
    # the two rollouts of one (task, seed) slot start from the same layout and anchor
    first = a.start.nonzero()[:, 0]
    assert torch.equal(a.image[first[0]], a.image[first[1]])
    assert a.anchor[first[0]] == a.anchor[first[1]] != a.anchor[first[2]]


def test_rollout_routing_per_arm():
    slots = [(1, 2), (1, 3), (0, 4)]
    traj = _rollout("trajectory", 0, slots)
    assert (switches_per_episode(traj.expert, traj.start, traj.episode) == 0).all()
    assert torch.equal(traj.router_step, traj.start)  # the router chooses at t = 0 only
    single = _rollout("single", 0, slots)
    assert (single.expert == 0).all()
    assert expert_shares(single, TINY.tasks, 1)["doorkey"] == [1.0]
    pamoe = _rollout("pamoe", 0, slots)
    assert pamoe.router_step.all() and pamoe.expert.max() < 4
    # at τ = 2 an untrained router switches often
    assert switches_per_episode(pamoe.expert, pamoe.start, pamoe.episode).sum() > 0
    assert set(pamoe.phase[pamoe.task[pamoe.episode] == 1].tolist()) <= {0, 1, 2}
    shares = expert_shares(pamoe, TINY.tasks, 4)
    counts = torch.bincount(pamoe.expert[pamoe.task[pamoe.episode] == 0], minlength=4)
    assert shares["empty"] == pytest.approx((counts / counts.sum()).tolist())
    assert all(sum(v) == pytest.approx(1.0) for v in shares.values())
    assert (pamoe.phase[pamoe.task[pamoe.episode] == 0] == -1).all()


def test_nmi_on_a_hand_made_case():
    phase = torch.tensor([0, 0, 1, 1, 2, 2])
    assert expert_phase_nmi(torch.tensor([3, 3, 1, 1, 0, 0]), phase, 4, 3) == pytest.approx(1.0)
    assert expert_phase_nmi(torch.tensor([0, 0, 0, 0, 0, 0]), phase, 4, 3) == 0.0
    # experts (0,0,0,1,1,1) vs phases (0,0,1,1,2,2): I = H(E) − H(E|P) = ln2 − (1/3)ln2,
    # H(P) = ln3 → NMI = (2/3)ln2 / ((ln2 + ln3)/2)
    import math

    want = (2 / 3) * math.log(2) / ((math.log(2) + math.log(3)) / 2)
    got = expert_phase_nmi(torch.tensor([0, 0, 0, 1, 1, 1]), phase, 2, 3)
    assert got == pytest.approx(want)
    assert expert_phase_nmi(torch.tensor([0, 1]), torch.tensor([2, 2]), 2, 3) == 0.0  # one phase
    with pytest.raises(InvalidValueError, match="phase"):
        expert_phase_nmi(torch.tensor([0]), torch.tensor([3]), 2, 3)


def test_train_checkpoint_resume_and_metrics(tmp_path):
    ckpt = tmp_path / "run.pt"
    run = train_policy(TINY, 0, checkpoint=ckpt)
    assert run.frames >= 300 and len(run.curve) >= 2 and ckpt.is_file()
    assert all(f >= 150 for f in run.curve) and max(run.curve) == run.frames
    assert checkpoint_frames(ckpt) == run.frames and checkpoint_frames(tmp_path / "no") is None
    again = train_policy(TINY, 0, checkpoint=ckpt)  # resumes at the end: nothing left to do
    assert again.curve == run.curve and again.updates == run.updates
    for a, b in zip(again.policy.parameters(), run.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(CheckpointError, match="another config or seed"):
        train_policy(TINY, 1, checkpoint=ckpt)
    m = PAMoERecipe().run(dataclasses.replace(TINY, arm="step"), 0)
    assert 0.0 <= m["success/doorkey"] <= 1.0 and m["reached_target"] in (0.0, 1.0)
    assert {"curve/doorkey/150", "curve/empty/300", "nmi", "switches", "auc"} <= set(m)


def test_bad_inputs_raise():
    with pytest.raises(InvalidValueError, match="arm"):
        RLConfig(arm="token")
    with pytest.raises(InvalidValueError, match="task_weights"):
        RLConfig(task_weights=(1.0,))
    with pytest.raises(InvalidValueError, match="sum to 1"):
        TaskMix.build(["MiniGrid-Empty-5x5-v0"], [0.5])
    with pytest.raises(InvalidValueError, match="not a registered"):
        make_env("MiniGrid-Nope-v0")
    with pytest.raises(InvalidValueError, match="clip"):
        RLConfig(clip=1.5)
