"""DeepSeek-V3 MoE blocks: moelab's MoELayer equals transformers' DeepseekV3MoE."""

from __future__ import annotations

import pytest
import torch

from moelab.interop import (
    MissingTensorError,
    UnexpectedTensorError,
    UnsupportedConfigError,
    deepseek_v3_config_fields,
    export_deepseek_v3_moe,
    import_deepseek_v3_moe,
)


def _block(hf, seed=0, **over):
    t = hf.transformers
    kw = dict(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=50,
    )
    kw.update(over)
    cfg = t.DeepseekV3Config(**kw)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(seed)
    block = hf.randomise(DeepseekV3MoE(cfg), seed).eval()
    with torch.no_grad():  # a bias large enough to change which experts are selected
        block.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, kw["n_routed_experts"]))
    return cfg, block


@pytest.mark.parametrize(
    "over",
    [
        dict(),
        dict(norm_topk_prob=False, routed_scaling_factor=1.0),
        dict(hidden_size=16, moe_intermediate_size=16, n_group=2, topk_group=1, n_shared_experts=1),
    ],
    ids=["groups4of8-k3", "no-norm", "D==F"],
)
def test_block_outputs_match(hf, over):
    cfg, block = _block(hf, **over)
    layer = import_deepseek_v3_moe(block.state_dict(), cfg.to_dict())
    assert torch.equal(layer.router.expert_bias, block.gate.e_score_correction_bias)
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = block(x), layer(x).hidden_states
    diff = float((ref - got).abs().max())
    print(f"deepseek_v3 {over}: max |Δ| = {diff:.2e}")
    assert diff < 1e-5
    assert ref.abs().amax() > 0.1


def test_bias_changes_routing(hf):
    """The correction bias is not vacuous: zeroing it changes the outputs."""
    cfg, block = _block(hf)
    layer = import_deepseek_v3_moe(block.state_dict(), cfg.to_dict())
    x = torch.randn(4, 8, 32)
    with torch.no_grad():
        base = layer(x).hidden_states
        layer.router.expert_bias.zero_()
        assert float((layer(x).hidden_states - base).abs().max()) > 1e-3


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_round_trip_with_prefix(hf, layout):
    cfg, block = _block(hf, seed=2)
    prefix = "model.layers.3.mlp."
    sd = {prefix + k: v for k, v in block.state_dict().items()}
    sd["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] = torch.ones(2)  # outside prefix
    layer = import_deepseek_v3_moe(sd, cfg.to_dict(), prefix)
    out = export_deepseek_v3_moe(layer, prefix, layout=layout)
    if layout == "fused":
        assert set(out) == {k for k in sd if k.startswith(prefix)}
        assert all(torch.equal(out[k], sd[k]) for k in out)
    else:
        assert f"{prefix}experts.7.down_proj.weight" in out
        again = import_deepseek_v3_moe(out, cfg.to_dict(), prefix)
        for (n, a), (_, b) in zip(
            layer.state_dict().items(), again.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), n
    fields = deepseek_v3_config_fields(layer)
    assert fields["n_shared_experts"] == 2 and fields["n_group"] == 4


def test_missing_bias_and_extra_tensor(hf):
    cfg, block = _block(hf)
    sd = dict(block.state_dict())
    sd.pop("gate.e_score_correction_bias")
    with pytest.raises(MissingTensorError, match="e_score_correction_bias"):
        import_deepseek_v3_moe(sd, cfg.to_dict())
    sd = dict(block.state_dict(), **{"gate.bias": torch.zeros(8)})
    with pytest.raises(UnexpectedTensorError, match=r"gate\.bias"):
        import_deepseek_v3_moe(sd, cfg.to_dict())


def test_unsupported_fields(hf):
    cfg, block = _block(hf)
    d = cfg.to_dict()
    with pytest.raises(UnsupportedConfigError, match="scoring_func"):
        import_deepseek_v3_moe(block.state_dict(), {**d, "scoring_func": "softmax"})
    with pytest.raises(UnsupportedConfigError, match="n_group"):
        import_deepseek_v3_moe(block.state_dict(), {**d, "n_group": 8, "topk_group": 2})
