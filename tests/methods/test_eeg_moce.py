"""The EEG-MoCE recipe on tiny synthetic sets: the Euclidean twin's attention is ordinary
attention, gradients reach every k through its modality stack, the optimiser groups, the
BatchNorm refit, the metrics, every arm end to end, config and CLI errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

pytest.importorskip("geoopt")

from moelab.cli import app
from moelab.data.eeg import pair_sets
from moelab.data.ts_format import TimeSeriesSet
from moelab.errors import InvalidValueError
from moelab.methods.multimodal import (
    ARMS,
    EEGMoCEConfig,
    EEGMoCERecipe,
    EuclideanCrossAttention,
    build_model,
)
from moelab.methods.multimodal.loop import (
    curvature_parameters,
    fit,
    make_optimizer,
    refit_batchnorm,
)
from moelab.methods.multimodal.metrics import balanced_accuracy, macro_f1
from moelab.methods.runner import run_seeds

from ..cli_checks import cli_error

TINY = dict(
    filters=4, steps=4, pool=2, fusion_hidden=8, kernel=5, depthwise_kernel=3, batch_size=16
)


def _set(n, channels, length, seed, shift):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    X = rng.normal(size=(n, channels, length))
    X[:, 0] += shift * np.where(y == 1, 1.0, -1.0)[:, None]
    return TimeSeriesSet(X, y, ("neg", "pos"), f"s{seed}")


def _sources():
    """A: a strong class shift on channel 0; B: weak; C: pure noise."""
    return {
        "A": (_set(60, 2, 16, 0, 1.5), _set(40, 2, 16, 1, 1.5)),
        "B": (_set(30, 3, 10, 2, 0.2), _set(20, 3, 10, 3, 0.2)),
        "C": (_set(30, 1, 12, 4, 0.0), _set(20, 1, 12, 5, 0.0)),
    }


def test_the_euclidean_twin_attention_is_ordinary_masked_attention():
    torch.manual_seed(0)
    layer = EuclideanCrossAttention(6, 8, num_heads=1).double()
    x = torch.randn(5, 3, 6, dtype=torch.float64)
    y, attn = layer(x)
    allowed = ~torch.eye(3, dtype=torch.bool)
    q, k, v = layer.q[0](x), layer.k[0](x), layer.v[0](x)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(y, want)
    assert torch.equal(torch.diagonal(attn[:, 0], dim1=-2, dim2=-1), torch.zeros(5, 3).double())


def test_gradients_reach_every_modality_k_and_the_fixed_arm_has_none():
    data = pair_sets(_sources(), seed=0)
    model = build_model(EEGMoCEConfig(**TINY), data)
    x = {m: torch.from_numpy(v) for m, v in data.train.inputs.items()}
    logits, attn = model(x)
    assert logits.dtype == torch.float64 and attn.shape == (1, 48, 2, 3, 3)
    F.cross_entropy(logits, torch.from_numpy(data.train.y)).backward()
    ks = curvature_parameters(model)
    assert len(ks) == 3
    assert all(k.grad is not None and torch.isfinite(k.grad) and k.grad != 0 for k in ks)
    fixed = build_model(EEGMoCEConfig(arm="fixed_k", **TINY), data)
    assert curvature_parameters(fixed) == []


def test_curvatures_get_no_weight_decay_and_stay_above_k_min():
    data = pair_sets(_sources(), seed=0)
    config = EEGMoCEConfig(**TINY, lr=0.2, max_epochs=3, min_epochs=0, k_min=0.5)
    model = build_model(config, data)
    opt = make_optimizer(model, config)
    rest, curv = opt.param_groups
    assert rest["weight_decay"] == 1e-3 and curv["weight_decay"] == 0.0
    assert {id(p) for p in curv["params"]} == {id(p) for p in curvature_parameters(model)}
    assert len(rest["params"]) + 3 == sum(p.requires_grad for p in model.parameters())
    t = {m: torch.from_numpy(v) for m, v in data.train.inputs.items()}
    v = {m: torch.from_numpy(v) for m, v in data.val.inputs.items()}
    y_t, y_v = torch.from_numpy(data.train.y), torch.from_numpy(data.val.y)
    assert fit(model, (t, y_t), (v, y_v), config, 0).epochs == 3
    ks = model.curvatures().values()
    # lr 0.2 moves k by ~0.2 a step: those pushed down sit at the floor 0.5 = k_init
    assert min(ks) >= 0.5 and max(ks) > 0.5


def test_refit_batchnorm_takes_the_statistics_of_the_given_inputs():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(2, 3, 1).double()
    bn = torch.nn.BatchNorm1d(3).double()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = conv, bn

        def forward(self, inputs):
            return self.bn(self.conv(inputs["x"])), None

    net = Net()
    x = torch.randn(7, 2, 5, dtype=torch.float64) * 3 + 2
    refit_batchnorm(net, {"x": x})
    h = conv(x).detach()
    torch.testing.assert_close(bn.running_mean, h.mean(dim=(0, 2)))
    torch.testing.assert_close(bn.running_var, h.var(dim=(0, 2), unbiased=True))
    assert not net.training and bn.momentum == 0.1


def test_metrics_hand_cases():
    y = np.array([0, 0, 0, 0, 1, 1])
    pred = np.array([0, 0, 0, 1, 1, 0])
    assert balanced_accuracy(y, pred) == pytest.approx((3 / 4 + 1 / 2) / 2)
    # class 0: tp 3, fp 1, fn 1 → 6/8; class 1: tp 1, fp 1, fn 1 → 2/4
    assert macro_f1(y, pred) == pytest.approx((6 / 8 + 2 / 4) / 2)


def test_every_arm_runs_and_the_informative_modality_is_learned():
    base = EEGMoCEConfig(**TINY, max_epochs=15, min_epochs=0, patience=15)
    result = run_seeds(EEGMoCERecipe(_sources()), base, [0], arms={a: {"arm": a} for a in ARMS})
    m = {a: result.metrics[a][0] for a in ARMS}
    assert set(m["moce"]) >= {"bal_acc", "macro_f1", "k_A", "k_B", "k_C", "attn_A", "attn_C"}
    assert "k_A" not in m["euclid"] and "attn_A" in m["euclid"]
    assert set(m["unimodal_hyp"]) >= {"k_A"} and "attn_A" not in m["unimodal_hyp"]
    assert m["fixed_k"]["k_A"] == m["fixed_k"]["k_C"] == 0.5
    assert m["moce"]["k_A"] != 0.5
    assert sum(m["moce"][f"attn_{x}"] for x in "ABC") == pytest.approx(1.0)
    # channel 0 of A carries a ±1.5 class shift: every arm should find it
    for arm in ARMS:
        assert m[arm]["bal_acc"] >= 0.85, (arm, m[arm])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(arm="hyperbolic"), "arm: must be one of"),
        (dict(min_epochs=200), "min_epochs: must be in [0, max_epochs=100]"),
        (dict(pool=32), "pool: must be <= steps=16"),
        (dict(k_init=0.0), "k_init: must be > 0"),
        (dict(linear_l2=()), "linear_l2: must be finite numbers"),
    ],
)
def test_bad_config_is_refused(kwargs, words):
    with pytest.raises(InvalidValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        EEGMoCEConfig(**kwargs)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--arms", "moce,bogus"], "--arms: unknown arm 'bogus'"),
        (["--arms", "moce,moce"], "--arms: must be distinct"),
        (["--seeds", "0,x"], "--seeds: 'x' is not a seed"),
        (["--seeds", "-1"], "--seeds"),
        (["--max-epochs", "0"], "--max-epochs: must be >= 1, got 0"),
        (["--k-init", "0"], "--k-init: must be > 0"),
    ],
)
def test_cli_refuses_bad_options(args, words):
    assert words in cli_error(CliRunner().invoke(app, ["eeg", "train", *args]))
