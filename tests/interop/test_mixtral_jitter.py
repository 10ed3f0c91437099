"""transformers' Mixtral ``router_jitter_noise`` multiplies the hidden states that feed both
the router and the experts; an imported Mixtral does the same in training mode."""

from __future__ import annotations

import pytest
import torch

from moelab.interop import import_hf


def test_training_forward_with_jitter_matches_transformers(hf, tmp_path):
    ref_model = hf.model("mixtral", router_jitter_noise=0.3)
    model, _ = import_hf(hf.save(ref_model, tmp_path / "hf", "fused"))
    assert model.cfg.moe.router.jitter_experts
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    ref_model.train()
    model.train()
    with torch.no_grad():
        torch.manual_seed(7)
        ref = ref_model(ids).logits
        torch.manual_seed(7)
        got = model(ids).logits
        torch.manual_seed(8)
        other = model(ids).logits
    assert (ref - got).abs().max() < 1e-4
    assert (other - got).abs().max() > 1e-3  # the jitter is really on


def test_exporting_a_dense_model_is_a_clear_error_not_an_assert():
    from moelab.interop import UnsupportedConfigError
    from moelab.interop.hf_weights import model_rules
    from moelab.models import ModelConfig, dense_twin_config

    dense = dense_twin_config(ModelConfig.tiny())
    with pytest.raises(UnsupportedConfigError, match="moe"):
        model_rules(dense, "mixtral", "fused")
