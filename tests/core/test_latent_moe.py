"""Multi-Head LatentMoE against a per-head, per-expert loop; config checks; bias update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moelab.core.latent_moe import LatentMoEConfig, MultiHeadLatentMoE
from moelab.models import ModelConfig, MoETransformer, load_model, save_model


def _reference(layer: MultiHeadLatentMoE, x):
    """Loop over tokens, heads and selected experts (float64)."""
    cfg = layer.config
    H, dh, E, k = cfg.num_heads, cfg.head_dim, cfg.num_experts, cfg.top_k
    out = []
    for t in x.reshape(-1, x.shape[-1]).double():
        s = layer.fc_mh.weight.double() @ t
        heads = []
        for h in range(H):
            sh = s[h * dh : (h + 1) * dh]
            logits = layer.router[h].double() @ sh
            chosen = sorted(range(E), key=lambda e: -(logits[e] + layer.expert_bias[h, e]).item())
            chosen = chosen[:k]
            gates = torch.softmax(torch.stack([logits[e] for e in chosen]), 0)
            y = torch.zeros(dh, dtype=torch.float64)
            for g, e in zip(gates, chosen, strict=True):
                K = layer.experts.w_up[h * E + e].double()  # [d_h, m]
                V = layer.experts.w_down[h * E + e].double()  # [m, d_h]
                y = y + g * (F.gelu(sh @ K) @ V)
            heads.append(y)
        out.append(layer.fc_mg.weight.double() @ torch.cat(heads))
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_forward_equals_per_head_per_expert_reference(k):
    torch.manual_seed(0)
    cfg = LatentMoEConfig(num_heads=3, head_dim=4, num_experts=5, top_k=k, expert_size=6)
    layer = MultiHeadLatentMoE(cfg, d_model=8)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.randn(3, 5) * 0.05)  # the bias moves selection only
    x = torch.randn(2, 7, 8)
    y = layer(x)
    assert y.shape == x.shape
    assert torch.allclose(y.double(), _reference(layer, x), atol=1e-6)


def test_gates_are_softmax_of_clean_selected_logits_and_bias_update():
    torch.manual_seed(1)
    cfg = LatentMoEConfig(num_heads=2, head_dim=4, num_experts=4, top_k=2, expert_size=4)
    layer = MultiHeadLatentMoE(cfg, d_model=8)
    with torch.no_grad():
        layer.expert_bias[:, 3] = 100.0  # expert 3 always selected; its gate stays clean
    s = torch.randn(6, 2, 4)
    logits, gates, idx = layer.route(s)
    assert (idx[..., 0] == 3).all()
    assert torch.allclose(gates, logits.gather(-1, idx).softmax(-1))
    layer.train()
    layer(torch.randn(5, 8)).sum().backward()
    counts = layer._counts.clone()
    assert counts.sum() == 5 * 2 * 2 and (counts[:, 3] == 5).all()
    before = layer.expert_bias.clone()
    layer.update_bias(rate=0.5)
    E = 4
    u = torch.sign(counts.sum(-1, keepdim=True) - E * counts).float()
    assert torch.allclose(layer.expert_bias - before, 0.5 * (u - u.mean(-1, keepdim=True)))
    assert layer._counts is None and layer.update_bias() is None


def test_config_errors_and_model_option_round_trip(tmp_path):
    with pytest.raises(ValueError, match="top_k"):
        LatentMoEConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="num_heads"):
        LatentMoEConfig(num_heads=0)
    lat = LatentMoEConfig(num_heads=2, head_dim=8, num_experts=4, top_k=2, expert_size=8)
    with pytest.raises(ValueError, match="latent_moe"):
        ModelConfig.tiny(latent_moe=lat)  # moe is set too
    assert ModelConfig.tiny().latent_moe is None  # default: unchanged models
    cfg = ModelConfig(
        vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, moe=None, latent_moe=lat
    )
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    model = MoETransformer(cfg)
    assert all(isinstance(b.ffn, MultiHeadLatentMoE) for b in model.blocks)
    resid = 0.02 / (2 * 2) ** 0.5
    assert abs(model.blocks[0].ffn.fc_mg.weight.std().item() - resid) < resid * 0.3
    ids = torch.randint(0, 32, (2, 8))
    save_model(model, tmp_path / "m")
    again = load_model(tmp_path / "m")
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert lat.active_params(16) == 2 * 16 * 16 + 2 * (8 * 4 + 2 * 2 * 8 * 8)


def test_bias_rate_defaults_to_50_times_the_peak_learning_rate():
    """The authors tie γ to the learning rate (auxfree_update_ratio = 50 · max lr); the
    training step passes that rate when the config leaves it None."""
    from moelab.train.config import TrainConfig
    from moelab.train.loop_step import apply_update

    lat = LatentMoEConfig(num_heads=2, head_dim=16, num_experts=4, top_k=2, expert_size=8)
    assert lat.bias_update_rate is None
    torch.manual_seed(0)
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    model = MoETransformer(ModelConfig(moe=None, latent_moe=lat, **base))
    layer = model.blocks[0].ffn
    ids = torch.randint(0, 64, (2, 9))
    model.loss(ids[:, :-1], ids[:, 1:]).loss.backward()
    counts = layer._counts.clone()
    before = layer.expert_bias.clone()
    with pytest.raises(ValueError, match="bias_update_rate"):
        layer.update_bias()  # nothing to tie it to outside training
    layer._counts = counts
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    apply_update(model, opt, [], [], TrainConfig(lr=3e-3, grad_clip=0.0), None)
    u = torch.sign(counts.sum(-1, keepdim=True) - 4 * counts).float()
    step = layer.expert_bias - before
    assert torch.allclose(step, 50 * 3e-3 * (u - u.mean(-1, keepdim=True)))
    assert step.abs().max() > 0
