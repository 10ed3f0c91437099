"""Scale-out over ``torch.distributed``: expert parallelism (all-to-all dispatcher, experts
sharded over EP groups nested in data parallelism), Head Parallel for Multi-Head LatentMoE,
FSDP2 for the non-expert parameters, and DCP sharded checkpoints that reshard on load."""

from moelab.parallel.checkpoint import consolidate, load_sharded, save_sharded
from moelab.parallel.comm import CommStats, ParallelGroups, all_to_all, build_groups
from moelab.parallel.expert_parallel import AllToAllDispatcher
from moelab.parallel.head_parallel import HeadParallelDispatcher
from moelab.parallel.shard import full_state_dict, shard_model
from moelab.parallel.strategy import ExpertParallel

__all__ = [
    "AllToAllDispatcher",
    "CommStats",
    "ExpertParallel",
    "HeadParallelDispatcher",
    "ParallelGroups",
    "all_to_all",
    "build_groups",
    "consolidate",
    "full_state_dict",
    "load_sharded",
    "save_sharded",
    "shard_model",
]
