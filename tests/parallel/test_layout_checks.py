"""Layout errors that need no process group: a clear ValueError naming the flag and the layer."""

from __future__ import annotations

import pytest
import torch
from parallel_workers import tiny_lm_config

from moelab.compress.quant import QuantizeConfig, quantize_model
from moelab.core.experts import QuantSpec
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


def test_expert_banks_that_cannot_be_cut_are_refused_by_name():
    """A quantized bank keeps its experts in bit-packed buffers: sharding it used to give each
    rank fresh random experts; it is refused, naming the layer and the bank kind."""
    torch.manual_seed(0)
    model = MoETransformer(tiny_lm_config())
    ids = torch.randint(0, 40, (2, 8))
    spec = QuantSpec(method="rtn", bits=4, group_size=4)
    quantize_model(model, [ids], QuantizeConfig(spec=spec, min_tokens=0))
    with pytest.raises(
        ValueError, match=r"--expert-parallel: layer blocks\.0\.ffn holds a QuantizedExpertBank"
    ):
        check_shardable(model, 2)
    check_shardable(model, 1)  # one rank keeps the whole bank: nothing to cut


@pytest.mark.parametrize("ep", [0, -1, 3, 2.0, True])
def test_expert_parallel_value_checked_against_world(ep):
    with pytest.raises(ValueError, match="--expert-parallel"):
        check_expert_parallel(ep, 4)


def test_fsdp_needs_distributed_run():
    with pytest.raises(ValueError, match="--fsdp"):
        ExpertParallel(1, fsdp=True).prepare(MoETransformer(tiny_lm_config()))
