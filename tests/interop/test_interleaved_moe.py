"""Interleaved MoE layers (``moe_layer_step``, HF ``decoder_sparse_step``): an imported
Qwen2-MoE with a sparse step gives transformers' logits and exports back."""

from __future__ import annotations

import pytest
import torch

from moelab.interop import export_hf, import_hf
from moelab.models import ModelConfig, MoETransformer


def test_moe_every_second_layer():
    cfg = ModelConfig.tiny(n_layers=5, moe_layer_step=2)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, True, False, True, False]
    model = MoETransformer(cfg)
    out = model(torch.randint(0, 64, (1, 4)))
    assert [r is not None for r in out.records] == [False, True, False, True, False]
    cfg = ModelConfig.tiny(n_layers=6, first_dense_layers=2, moe_layer_step=3)
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [2, 5]
    with pytest.raises(ValueError, match="moe_layer_step"):
        ModelConfig.tiny(n_layers=2, moe_layer_step=0)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_decoder_sparse_step_matches_transformers(hf, tmp_path, arch):
    over = dict(num_hidden_layers=4, decoder_sparse_step=2)
    if arch == "qwen2_moe":
        over["mlp_only_layers"] = []
    ref_model = hf.model(arch, **over)
    model, _ = import_hf(hf.save(ref_model, tmp_path / "hf", "fused"))
    assert model.cfg.moe_layer_step == 2
    assert [b.is_moe for b in model.blocks] == [False, True, False, True]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ref_model(ids).logits - model(ids).logits).abs().max() < 1e-4
    out = export_hf(model, tmp_path / "back")
    reloaded = hf.transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.decoder_sparse_step == 2
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_mlp_only_layers_anywhere_import_as_explicit_placement(hf, tmp_path, arch):
    # dense layers 1 and 3 (not a prefix): moelab's explicit moe_layers carries them
    ref_model = hf.model(arch, num_hidden_layers=4, mlp_only_layers=[1, 3])
    model, _ = import_hf(hf.save(ref_model, tmp_path / "hf", "fused"))
    assert model.cfg.moe_layers == (0, 2)
    assert [b.is_moe for b in model.blocks] == [True, False, True, False]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ref_model(ids).logits - model(ids).logits).abs().max() < 1e-4
    out = export_hf(model, tmp_path / "back")
    reloaded = hf.transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert list(reloaded.config.mlp_only_layers) == [1, 3]
    with torch.no_grad():
        assert (reloaded(ids).logits - model(ids).logits).abs().max() < 1e-4


def test_explicit_placement_refused_by_an_all_moe_architecture(tmp_path):
    model = MoETransformer(ModelConfig.tiny(n_layers=3, moe_layers=(0, 2)))
    with pytest.raises(ValueError, match=r"moe_layers.*mixtral.*no dense layers"):
        export_hf(model, tmp_path / "out", arch="mixtral")
