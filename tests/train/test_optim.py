"""The loop's AdamW: torch's fused kernel on whole parameters gives the default loop's update,
also after loading a checkpoint saved without it; shards of an expanded parameter (strided
views) stay off it."""

import torch

from moelab.models import MoETransformer
from moelab.train.config import TrainConfig
from moelab.train.expand import ExpandSpec, expand_live
from moelab.train.optim import PlainAdamW, build_optimizer

from .conftest import tiny_model

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _steps(model, opt, n):
    for _ in range(n):
        model.loss(IDS, IDS).loss.backward()
        opt.step()
        opt.zero_grad()


def _trained_two_steps():
    torch.manual_seed(0)
    model = MoETransformer(tiny_model())
    cfg = TrainConfig(lr=1e-2)
    opt = build_optimizer(model, cfg)
    _steps(model, opt, 2)
    return model, cfg, opt


def test_fused_adamw_matches_the_default_loop():
    torch.manual_seed(0)
    ours = MoETransformer(tiny_model())
    ref = MoETransformer(tiny_model())
    ref.load_state_dict(ours.state_dict())
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(ours, cfg)
    assert [g["fused"] for o in opt.optimizers for g in o.param_groups] == [True, True]
    plain = PlainAdamW(ref, cfg)  # the same groups on torch's default (unfused) loop
    _steps(ours, opt, 3)
    _steps(ref, plain, 3)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_expanded_shards_are_not_fused_and_update_like_the_default_loop():
    model, cfg, opt = _trained_two_steps()
    e = expand_live(model, opt, ExpandSpec(hidden=2), cfg, step=2, calib_ids=None, seed=0)
    assert all(g["fused"] is None for o in e.optimizer.optimizers for g in o.param_groups)
    e.model.loss(IDS, IDS).loss.backward()
    name = "blocks.0.attn.q_proj.weight"
    grad = dict(e.model.named_parameters())[name].grad.clone()
    e.optimizer.step()
    # a new shard's first moment after one step is exactly (1 - beta1) * its gradient slice
    new = [
        t
        for g, shards in zip(e.optimizer.layout, e.optimizer.shards, strict=True)
        for (n, region), t in zip(g["shards"], shards, strict=True)
        if n == name and region is not None and region[1][0] > 0
    ]
    assert new
    width = new[0].shape[1]
    torch.testing.assert_close(
        e.optimizer.state_of(new[0])["exp_avg"],
        (1 - cfg.beta1) * grad[:, -width:],
        rtol=1e-6,
        atol=1e-12,
    )


def test_a_checkpoint_saved_without_the_fused_kernel_resumes_on_it():
    model, cfg, opt = _trained_two_steps()
    sd = opt.state_dict()
    for osd in sd["optimizers"]:  # as written before the loop used the fused kernel
        for g in osd["param_groups"]:
            g["fused"] = None
    resumed = build_optimizer(model, cfg, sd)
    assert [g["fused"] for o in resumed.optimizers for g in o.param_groups] == [True, True]
    assert float(resumed.state_of(next(model.parameters()))["step"]) == 2
