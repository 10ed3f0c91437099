"""Training under EP × DP (± FSDP2) equals single-process training; sharded checkpoints
reshard on load."""

from __future__ import annotations

import pytest
import torch
from parallel_workers import (
    ep_dp_training,
    expert_memory,
    frozen_through_sharding,
    load_at,
    save_at,
    tiny_lm_config,
    train_steps,
)

from moelab.models import MoETransformer, load_model
from moelab.parallel import ParallelGroups, consolidate, load_sharded
from moelab.parallel.checkpoint import latest_sharded_dir
from moelab.parallel.launch import spawn_ranks as run_ranks


def _single_process(world, steps=20, latent=False):
    torch.manual_seed(0)
    model = MoETransformer(tiny_lm_config(latent=latent)).double()
    losses, _ = train_steps(model, steps, world, 0)
    return losses, model.state_dict()


@pytest.mark.slow
def test_20_steps_ep_dp_equal_single_process():
    """EP=2 × DP=2 on 4 ranks, without and with FSDP2. The LM loss is computed in float32
    (model.loss), the rest in float64, hence rel=1e-6."""
    ref_losses, ref_state = _single_process(4)
    assert ref_losses[-1] < ref_losses[0] - 0.3  # it trained
    bias = [k for k in ref_state if k.endswith("expert_bias")]
    assert bias and all(ref_state[k].abs().sum() > 0 for k in bias)
    results = run_ranks(ep_dp_training, 4, ep=2, fsdp=(False, True))
    for rank in results:
        for run in rank:
            assert run["losses"] == pytest.approx(ref_losses, rel=1e-6)
    for run in results[0]:
        for k, v in ref_state.items():
            assert torch.allclose(run["state"][k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
def test_fsdp_shards_experts_over_dp_halving_their_memory():
    """EP=2 × DP=2: FSDP2 on the experts (over each EP shard's DP group of 2) halves every
    rank's expert parameter + AdamW-state bytes and trains exactly as the replicated run."""
    results = run_ranks(expert_memory, 4, ep=2)
    # tiny_lm_config: 2 layers × (w_gate_up [4, 16, 16] + w_down [4, 8, 16]) float64, 2 of
    # the 4 experts per EP rank; weights + exp_avg + exp_avg_sq = 3 copies
    replicated = 3 * 2 * 2 * (16 * 16 + 8 * 16) * 8
    for r in results:
        assert r[False]["bytes"] == replicated
        assert r[True]["bytes"] * 2 == replicated
        assert r[True]["losses"] == pytest.approx(r[False]["losses"], rel=1e-6)  # fp32 loss
    for k, v in results[0][False]["state"].items():
        assert torch.allclose(results[0][True]["state"][k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.slow
def test_checkpoint_with_fsdp_sharded_experts_loads_in_one_process(tmp_path):
    saved = run_ranks(save_at, 4, ep=2, folder=str(tmp_path), fsdp=True)[0]
    model = MoETransformer(tiny_lm_config())
    load_sharded(latest_sharded_dir(tmp_path), model, [], ParallelGroups())
    for k, v in saved["model"].items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.slow
def test_head_parallel_training_equals_single_process():
    ref_losses, ref_state = _single_process(2, steps=8, latent=True)
    results = run_ranks(ep_dp_training, 2, ep=2, latent=True, steps=8)
    for (r,) in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6)
    state = results[0][0]["state"]
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6), k
    assert ref_state["blocks.0.ffn.expert_bias"].abs().sum() > 0


@pytest.mark.slow
def test_checkpoint_saved_at_ep4_loads_at_ep2_and_ep1(tmp_path):
    saved = run_ranks(save_at, 4, ep=4, folder=str(tmp_path))[0]
    loaded = run_ranks(load_at, 2, ep=2, folder=str(tmp_path))
    for r in loaded:
        assert r["trainer_state"] == {"step": 2}
        for part in ("model", "exp_avg"):
            for k, v in saved[part].items():
                assert torch.equal(r[part][k], v), (part, k)
    # EP = 1 in one process, and the conversion to a normal model folder
    model = MoETransformer(tiny_lm_config())
    load_sharded(latest_sharded_dir(tmp_path), model, [], ParallelGroups())
    out = consolidate(tmp_path, tmp_path.with_name(tmp_path.name + "-model"))  # not inside
    folder_model = load_model(out)
    for k, v in saved["model"].items():
        assert torch.equal(model.state_dict()[k], v), k
        assert torch.equal(folder_model.state_dict()[k], v), k
    assert any("experts" in k for k in saved["model"])


@pytest.mark.slow
def test_sharding_keeps_frozen_parameters_frozen():
    """``--lora-rank r --expert-parallel 2``: the base experts and their biases stay frozen
    after sharding and do not move in training; only the adapters (and the rest of the
    trainable model) do."""
    for r in run_ranks(frozen_through_sharding, 2, timeout=120):
        assert r["after"] == r["before"]
        assert r["latent_after"] == r["latent_before"]
        frozen = [n for n, t in r["before"].items() if not t]
        assert any(n.endswith("experts.w_gate_up") for n in frozen)
        assert any(n.endswith("experts.b_down") for n in frozen)
        for n in frozen:
            assert torch.equal(r["end"][n], r["start"][n]), n
        lora = [n for n in r["start"] if "lora_B" in n]
        assert lora and all(r["end"][n].abs().max() > 0 for n in lora)  # B starts at 0
