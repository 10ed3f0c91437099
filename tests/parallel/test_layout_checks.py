"""Layout errors that need no process group: a clear ValueError naming the flag and the layer."""

from __future__ import annotations

import pytest
from parallel_workers import tiny_lm_config

from moelab.models import MoETransformer
from moelab.parallel import ExpertParallel
from moelab.parallel.comm import check_expert_parallel
from moelab.parallel.shard import check_shardable


def test_expert_parallel_must_divide_experts_and_heads():
    with pytest.raises(ValueError, match=r"--expert-parallel: 3 does not divide the 4 experts"):
        check_shardable(MoETransformer(tiny_lm_config()), 3)
    with pytest.raises(ValueError, match=r"3 ranks do not divide the 4 heads"):
        check_shardable(MoETransformer(tiny_lm_config(latent=True)), 3)
    check_shardable(MoETransformer(tiny_lm_config(latent=True)), 2)  # fits


@pytest.mark.parametrize("ep", [0, -1, 3, 2.0, True])
def test_expert_parallel_value_checked_against_world(ep):
    with pytest.raises(ValueError, match="--expert-parallel"):
        check_expert_parallel(ep, 4)


def test_fsdp_needs_distributed_run():
    with pytest.raises(ValueError, match="--fsdp"):
        ExpertParallel(1, fsdp=True).prepare(MoETransformer(tiny_lm_config()))
