from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moelab.core import checks
from moelab.core.telemetry import RoutingRecord
from moelab.models import LMOutput, MoETransformer

from .checks import assert_causal, assert_kv_cache_matches_recomputation

KINDS = [dict(), dict(dense=True), dict(n_kv_heads=2), dict(n_kv_heads=1, dense=True)]
KIND_IDS = ["moe", "dense", "moe-gqa", "dense-mqa"]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_causality_future_token_never_changes_past_logits(model_factory, kind):
    assert_causal(model_factory(**kind))


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
def test_kv_cache_matches_full_recomputation(model_factory, kind):
    assert_kv_cache_matches_recomputation(model_factory(**kind))


def test_kv_cache_rewind_overwrites(model_factory):
    model = model_factory(n_kv_heads=2)
    torch.manual_seed(3)
    ids = torch.randint(0, 61, (1, 10))
    other = torch.randint(0, 61, (1, 4))
    with torch.no_grad():
        cache = model.new_kv_cache(1)
        model(ids, kv_cache=cache)
        model(other, kv_cache=cache, start_pos=10)  # speculative tokens, then rewind
        step = model(ids[:, 6:], kv_cache=cache, start_pos=6).logits
        full = model(ids).logits
    torch.testing.assert_close(step, full[:, 6:], rtol=1e-5, atol=1e-5)


def test_kv_cache_errors(model_factory):
    model = model_factory()
    ids = torch.randint(0, 61, (2, 4))
    cache = model.new_kv_cache(2, max_len=6)
    with torch.no_grad():
        with pytest.raises(ValueError, match="start_pos"):
            model(ids, kv_cache=cache, start_pos=2)  # gap: cache is empty
        model(ids, kv_cache=cache)
        with pytest.raises(ValueError, match="max_len=6"):
            model(ids, kv_cache=cache, start_pos=4)
        with pytest.raises(ValueError, match="batch_size"):
            model(ids[:1, :1], kv_cache=cache, start_pos=4)
    with pytest.raises(ValueError, match="start_pos"):
        model(ids, start_pos=1)
    with pytest.raises(ValueError, match="max_len"):
        model.new_kv_cache(2, max_len=1000)


def test_padding_mask_hides_masked_tokens(model_factory):
    """A masked-out (padding) token influences no real position, with or without cache."""
    model = model_factory(n_kv_heads=2)
    torch.manual_seed(4)
    ids = torch.randint(0, 61, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, 5] = False  # a hole
    changed = ids.clone()
    changed[0, :3] = (changed[0, :3] + 7) % 61
    changed[1, 5] = (changed[1, 5] + 7) % 61
    with torch.no_grad():
        a = model(ids, mask=mask).logits
        b = model(changed, mask=mask).logits
        torch.testing.assert_close(a[mask], b[mask], rtol=0, atol=1e-6)
        assert torch.isfinite(a).all()
        # without the mask the same change is visible
        c, d = model(ids).logits, model(changed).logits
        assert (c[0, 3:] - d[0, 3:]).abs().amax() > 1e-3
        # cached decoding remembers the padding of earlier steps
        cache = model.new_kv_cache(2)
        inc = [model(ids[:, :6], mask=mask[:, :6], kv_cache=cache).logits]
        for t in range(6, 12):
            inc.append(
                model(
                    ids[:, t : t + 1], mask=mask[:, t : t + 1], kv_cache=cache, start_pos=t
                ).logits
            )
    torch.testing.assert_close(torch.cat(inc, 1)[mask], a[mask], rtol=1e-5, atol=1e-5)


def test_mask_excludes_padding_from_moe_telemetry(model_factory):
    model = model_factory()
    ids = torch.randint(0, 61, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[:, 6:] = False
    with torch.no_grad():
        out = model(ids, mask=mask)
    for rec in out.records:
        assert int(rec.counts.sum()) == 12 * 2  # 12 real tokens, k = 2
        assert rec.token_mask.sum() == 12


def test_output_structure_and_aux_losses(model_factory):
    model = model_factory(first_dense_layers=1, n_layers=3)
    ids = torch.randint(0, 61, (2, 9))
    out = model(ids)
    assert isinstance(out, LMOutput)
    assert out.logits.shape == (2, 9, 61)
    assert out.records[0] is None
    assert all(isinstance(r, RoutingRecord) for r in out.records[1:])
    assert len(out.records) == 3
    assert set(out.aux_losses) == {"load_balance", "z_loss"}
    assert out.aux_loss.dtype == torch.float32 and out.aux_loss.dim() == 0
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values()))
    # aux losses are the per-layer sums: recompute layer by layer
    x = model.embed(ids)
    per_layer = []
    attn_mask = None
    for block in model.blocks:
        x, aux, _ = block(x, attn_mask=attn_mask)
        per_layer.append(aux)
    assert per_layer[0] == {}
    for name in out.aux_losses:
        torch.testing.assert_close(
            out.aux_losses[name], sum(layer[name] for layer in per_layer[1:])
        )
    # gradients reach the routers through the aux loss
    out.aux_loss.backward()
    assert model.blocks[1].ffn.router.weight.grad.abs().sum() > 0


def test_dense_model_has_no_aux_and_no_records(model_factory):
    out = model_factory(dense=True)(torch.randint(0, 61, (1, 5)))
    assert out.records == [None, None]
    assert out.aux_losses == {}
    assert out.aux_loss.item() == 0.0 and out.aux_loss.dtype == torch.float32


def test_loss_is_cross_entropy_in_nats_plus_aux(model_factory):
    model = model_factory()
    torch.manual_seed(5)
    ids = torch.randint(0, 61, (2, 10))
    targets = torch.randint(0, 61, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    targets[0, 2] = -100
    res = model.loss(ids, targets, mask=mask)
    logits = model(ids, mask=mask).logits
    keep = mask.clone()
    keep[0, 2] = False
    manual = F.cross_entropy(logits[keep], targets[keep])
    assert res.num_tokens == 16
    torch.testing.assert_close(res.ce, manual)
    torch.testing.assert_close(res.loss, res.ce + res.aux_loss)
    # an untrained model is near uniform: ce ≈ ln V
    assert abs(res.ce.item() - math.log(61)) < 1.0
    res.loss.backward()
    assert model.embed.weight.grad is not None


def test_tied_embeddings_share_one_tensor(model_factory):
    model = model_factory(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    untied = model_factory()
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 61 * 32


def test_init_scales_residual_projections():
    from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
    from moelab.models import ModelConfig

    torch.manual_seed(0)
    L, D = 8, 128
    cfg = ModelConfig(
        vocab_size=256,
        d_model=D,
        n_layers=L,
        n_heads=4,
        max_seq_len=16,
        first_dense_layers=1,
        dense_ffn_size=256,
        moe=MoEConfig(
            router=RouterConfig(num_experts=4, top_k=1),
            experts=ExpertsConfig(hidden_size=D, ffn_hidden_size=64),
        ),
    )
    m = MoETransformer(cfg)
    resid = 0.02 / math.sqrt(2 * L)

    def close(t, std):
        return abs(t.std().item() - std) < 0.05 * std

    assert close(m.embed.weight, 0.02) and close(m.lm_head.weight, 0.02)
    assert close(m.blocks[2].attn.q_proj.weight, 0.02)
    assert close(m.blocks[2].attn.o_proj.weight, resid)
    assert close(m.blocks[0].ffn.w_gate.weight, 0.02)
    assert close(m.blocks[0].ffn.w_down.weight, resid)
    assert close(m.blocks[3].ffn.experts.w_gate_up, 0.02)
    assert close(m.blocks[3].ffn.experts.w_down, resid)
    assert close(m.blocks[3].ffn.router.weight, 0.02)
    assert torch.equal(m.norm.weight, torch.ones(D))


def test_forward_input_validation(model_factory):
    model = model_factory()
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(6, dtype=torch.long))
    with checks.enabled(), pytest.raises(ValueError, match="vocab_size"):
        model(torch.full((1, 3), 61))
    with pytest.raises(ValueError, match="mask"):
        model(torch.zeros(1, 3, dtype=torch.long), mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 49, dtype=torch.long))


def test_bf16_forward_runs(model_factory):
    model = model_factory(n_kv_heads=2).to(torch.bfloat16)
    ids = torch.randint(0, 61, (2, 6))
    with torch.no_grad():
        out = model(ids)
        ref = model_factory(n_kv_heads=2)(ids)
    assert out.logits.dtype == torch.bfloat16
    assert out.aux_loss.dtype == torch.float32
    torch.testing.assert_close(out.logits.float(), ref.logits, atol=0.1, rtol=0.1)


def test_logits_at_equals_the_full_logits_at_those_positions(model_factory):
    model = model_factory()
    torch.manual_seed(5)
    ids = torch.randint(0, 61, (3, 9))
    at = torch.tensor([8, 0, 4])
    with torch.no_grad():
        full = model(ids)
        some = model(ids, logits_at=at)
    assert some.logits.shape == (3, 1, 61)
    torch.testing.assert_close(some.logits[:, 0], full.logits[torch.arange(3), at])
    torch.testing.assert_close(some.hidden_states, full.hidden_states)
    with checks.enabled(True):
        for bad in (torch.tensor([8, 0, 9]), torch.tensor([1, 2]), torch.tensor([1.0, 2, 3])):
            with pytest.raises(ValueError, match="logits_at"):
                model(ids, logits_at=bad)
