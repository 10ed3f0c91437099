"""Head Parallel: fixed, equal all-to-all sizes whatever k and the routing."""

from __future__ import annotations

import pytest
from parallel_workers import hp_send_sizes

from moelab.parallel.launch import spawn_ranks as run_ranks


@pytest.mark.slow
def test_hp_send_sizes_identical_across_ranks_and_k():
    world, T, H, dh = 4, 15, 8, 4
    results = run_ranks(hp_send_sizes, world)
    # two exchanges of T·(H/W)·d_h float64 elements to each of the W−1 peers
    expected = 2 * T * (H // world) * dh * 8 * (world - 1)
    for r in results:
        for k, v in r.items():
            assert v["bytes"] == expected, (k, v["bytes"])
            assert v["metadata"] == 0
            assert v["heads"] == H // world
            assert v["y"] < 1e-12 and v["dx"] < 1e-12, (k, v)
