import numpy as np
import pytest
import torch

from moelab.data.timeseries import WindowSet
from moelab.errors import InvalidValueError
from moelab.methods.forecasting import (
    DenseFFN,
    ForecastConfig,
    MMoE,
    PatchForecaster,
    RevIN,
    shuffle_texts,
)
from moelab.methods.forecasting.mmoe import routed


def test_revin_statistics_and_round_trip():
    rev = RevIN(eps=0.0)
    z, (mean, std) = rev.normalize(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert mean.item() == 2.5 and std.item() == pytest.approx(1.25**0.5)
    torch.testing.assert_close(z, (torch.tensor([[1.0, 2.0, 3.0, 4.0]]) - 2.5) / 1.25**0.5)
    rev = RevIN()
    with torch.no_grad():
        rev.weight.fill_(1.7)
        rev.bias.fill_(-0.3)
    x = torch.randn(5, 64, dtype=torch.float64) * 40 + 900
    z, stats = rev.double().normalize(x)
    torch.testing.assert_close(rev.denormalize(z, stats), x)


def test_patching_gives_41_tokens_and_a_flatten_head():
    c = ForecastConfig(arm="unimodal")
    assert c.num_patches == 41
    model = PatchForecaster(c, 1)
    assert model.head.in_features == 41 * 32
    assert PatchForecaster(ForecastConfig(arm="concat"), 7).head.in_features == 42 * 32
    out = model(torch.randn(3, 336))
    assert out.prediction.shape == (3, 48) and out.aux_loss.item() == 0.0
    # patch j of the unfold is x[8j : 8j + 16]
    x = torch.arange(336.0)[None]
    patches = x.unfold(-1, 16, 8)
    assert patches.shape == (1, 41, 16) and patches[0, 40, 0].item() == 320.0


def test_context_routing_is_per_sample():
    torch.manual_seed(0)
    mm = MMoE(8, 5, 6, num_experts=4, top_k=2)
    h, text = torch.randn(6, 5, 8), torch.randn(6, 6)
    for moe, ctx in ((mm.tmoe, text), (mm.smoe, h.reshape(6, 40))):
        out = moe(h, router_input=ctx[:, None].expand(6, 5, ctx.shape[1]))
        ids = out.plan.expert_idx.view(6, 5, 2)
        weights = out.plan.weight.view(6, 5, 2)
        assert torch.equal(ids, ids[:, :1].expand_as(ids))  # every token: its sample's experts
        torch.testing.assert_close(weights, weights[:, :1].expand_as(weights))
    out = mm(h, text)
    assert set(out.experts) == {"tmoe", "smoe"} and out.experts["tmoe"].shape == (6, 2)
    assert out.aux_loss.item() > 0
    # the text decides TMoE's experts: the same series, other texts, other experts
    _, _, a = routed(mm.tmoe, h, text)
    _, _, b = routed(mm.tmoe, h, -text)
    assert not torch.equal(a, b)


def test_one_expert_top1_plugin_equals_a_plain_ffn():
    torch.manual_seed(1)
    mm = MMoE(8, 5, 6, num_experts=1, top_k=1, use_series=False)
    ffn = DenseFFN(8, 16)
    with torch.no_grad():
        mm.tmoe.experts.w_up.copy_(ffn.up.weight.T[None])
        mm.tmoe.experts.b_up.copy_(ffn.up.bias[None])
        mm.tmoe.experts.w_down.copy_(ffn.down.weight.T[None])
        mm.tmoe.experts.b_down.copy_(ffn.down.bias[None])
    h = torch.randn(3, 5, 8)
    torch.testing.assert_close(mm(h, torch.randn(3, 6)).hidden_states, ffn(h).hidden_states)


def test_shuffled_control_permutes_exactly_the_text():
    n = 50
    w = WindowSet(
        np.random.rand(n, 4).astype(np.float32),
        np.random.rand(n, 2).astype(np.float32),
        np.arange(n) % 7,
        np.arange(n) % 3,
        np.arange(n),
    )
    s = shuffle_texts(w, np.random.default_rng(0))
    for f in ("x", "y", "event", "start"):
        assert np.array_equal(getattr(s, f), getattr(w, f))
    assert sorted(s.text_id.tolist()) == sorted(w.text_id.tolist())
    assert not np.array_equal(s.text_id, w.text_id)


def test_bad_inputs_are_refused():
    with pytest.raises(InvalidValueError, match="arm"):
        ForecastConfig(arm="late")
    with pytest.raises(InvalidValueError, match="top_k"):
        ForecastConfig(top_k=5)
    with pytest.raises(InvalidValueError, match="n_heads"):
        ForecastConfig(n_heads=5)
    with pytest.raises(InvalidValueError, match="lookback"):
        ForecastConfig(lookback=100)
    with pytest.raises(InvalidValueError, match="keep at least one"):
        MMoE(8, 5, 6, use_text=False, use_series=False)
    model = PatchForecaster(ForecastConfig(arm="mmoe"), 6)
    with pytest.raises(InvalidValueError, match="needs the text token"):
        model(torch.randn(2, 336))
    with pytest.raises(InvalidValueError, match=r"x: expected \[B, 336\]"):
        model(torch.randn(2, 300), torch.randn(2, 6))
