"""LoRA adapters on the stacked expert weights: the bank equals a plain bank with merged
weights, adapters start as a no-op, only they train, and a LoRA model saves, loads and
merges like any model."""

from __future__ import annotations

import pytest
import torch

from moelab.core.config import ExpertsConfig
from moelab.core.experts import ExpertBank
from moelab.models import ModelConfig, MoETransformer, load_model, save_model
from moelab.models.lora import add_expert_lora, freeze_all_but_lora, merge_expert_lora


def test_lora_bank_equals_bank_with_merged_weights():
    torch.manual_seed(0)
    E, D, F, r = 3, 6, 5, 2
    bank = ExpertBank(ExpertsConfig(D, F, lora_rank=r, lora_alpha=4.0), E)
    with torch.no_grad():
        bank.lora_B_in.normal_()
        bank.lora_B_down.normal_()
    plain = ExpertBank(ExpertsConfig(D, F), E)
    with torch.no_grad():
        plain.w_gate_up.copy_(bank.w_gate_up + 2.0 * bank.lora_A_in @ bank.lora_B_in)
        plain.w_down.copy_(bank.w_down + 2.0 * bank.lora_A_down @ bank.lora_B_down)
    x = torch.randn(9, D)
    counts = torch.tensor([4, 0, 5])
    assert torch.allclose(bank(x, counts), plain(x, counts), atol=1e-5)
    assert bank.lora_scale == 2.0


def test_add_train_save_load_merge(tmp_path):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=40, n_layers=2)).eval()
    ids = torch.randint(0, 40, (2, 7))
    base = model(ids).logits
    lora = add_expert_lora(model, rank=4, alpha=8.0)
    assert torch.allclose(lora(ids).logits, base, atol=1e-6)  # B = 0: a no-op at first
    n = freeze_all_but_lora(lora)
    assert n == 2 * (4 * (32 * 4 + 4 * 64) + 4 * (32 * 4 + 4 * 32))  # 2 layers, E=4, r=4
    lora.train()
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.5)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    for _ in range(3):
        opt.zero_grad()
        lora.loss(ids, ids.roll(-1, 1)).loss.backward()
        opt.step()
    after = lora.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    lora.eval()
    want = lora(ids).logits
    assert (want - base).abs().max() > 1e-4
    save_model(lora, tmp_path / "lora")
    again = load_model(tmp_path / "lora").eval()
    assert again.cfg.moe.experts.lora_rank == 4
    assert torch.allclose(again(ids).logits, want, atol=1e-6)
    merged = merge_expert_lora(again)
    assert merged.cfg.moe.experts.lora_rank == 0
    assert not any("lora_" in k for k in merged.state_dict())
    assert torch.allclose(merged(ids).logits, want, atol=1e-5)


def test_lora_errors():
    model = MoETransformer(ModelConfig.tiny(vocab_size=40, n_layers=1))
    with pytest.raises(ValueError, match="rank"):
        add_expert_lora(model, rank=0)
    with pytest.raises(ValueError, match="no LoRA"):
        merge_expert_lora(model)
    with pytest.raises(ValueError, match="already"):
        add_expert_lora(add_expert_lora(model, 2), 2)


def test_merge_lora_command(tmp_path):
    from typer.testing import CliRunner

    from moelab.cli import app
    from moelab.data import ByteTokenizer

    torch.manual_seed(0)
    lora = add_expert_lora(MoETransformer(ModelConfig.tiny(vocab_size=256, n_layers=1)), 2)
    with torch.no_grad():
        lora.blocks[0].ffn.experts.lora_B_down.normal_()
    save_model(lora, tmp_path / "run")
    ByteTokenizer().save(tmp_path / "run")
    res = CliRunner().invoke(
        app, ["merge-lora", str(tmp_path / "run"), "--out", str(tmp_path / "m")]
    )
    assert res.exit_code == 0, res.output
    merged = load_model(tmp_path / "m").eval()
    ids = torch.randint(0, 256, (1, 5))
    assert torch.allclose(merged(ids).logits, lora.eval()(ids).logits, atol=1e-5)
    again = CliRunner().invoke(
        app, ["merge-lora", str(tmp_path / "m"), "--out", str(tmp_path / "x")]
    )
    assert again.exit_code == 2 and "no LoRA" in again.output
