"""Expert parallel MoE layer on 2 and 4 gloo ranks against the single-process layer."""

from __future__ import annotations

import pytest
from parallel_workers import E, ep_forward_backward, remote_zero

from moelab.parallel.launch import spawn_ranks as run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_ep_forward_backward_equals_single_process(world, ep):
    results = run_ranks(ep_forward_backward, world, ep=ep)
    for r in results:
        assert r["local_experts"] == E // ep
        assert r["sharded"] == ["layer.experts.w_gate_up", "layer.experts.w_down"]
        for key in ("out", "dx", "router", "experts"):
            assert r[key] < 1e-6, (key, r[key])


@pytest.mark.slow
def test_remote_expert_slots_contribute_exactly_zero():
    for r in run_ranks(remote_zero, 2):
        assert r["n_remote_tokens"] > 0
        assert r["remote_out_max"] == 0.0
        assert r["remote_weight_grad_max"] == 0.0
        assert r["local_weight_grad_min"] > 0.0
        assert r["calls"] == 1
