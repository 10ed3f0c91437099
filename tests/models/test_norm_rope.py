from __future__ import annotations

import math

import pytest
import torch

from moelab.models import RMSNorm, RotaryEmbedding, rope_cos_sin


def test_rmsnorm_matches_hand_formula():
    torch.manual_seed(0)
    norm = RMSNorm(5, eps=1e-3)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0]))
    x = torch.randn(3, 4, 5)
    y = norm(x)
    for idx in [(0, 0), (1, 2), (2, 3)]:
        row = x[idx].tolist()
        rms = math.sqrt(sum(v * v for v in row) / 5 + 1e-3)
        expected = [v / rms * w for v, w in zip(row, [1.0, 2.0, -1.0, 0.5, 3.0], strict=True)]
        assert y[idx].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # a concrete value: x = [3, 4] -> rms = sqrt(12.5) (eps tiny)
    n2 = RMSNorm(2, eps=1e-12)
    assert n2(torch.tensor([3.0, 4.0])).tolist() == pytest.approx(
        [3 / math.sqrt(12.5), 4 / math.sqrt(12.5)], rel=1e-6
    )


def test_rmsnorm_bf16_keeps_dtype_and_is_close():
    torch.manual_seed(0)
    norm = RMSNorm(16)
    x = torch.randn(4, 16) * 10
    y = norm(x.bfloat16().float())
    yb = norm.to(torch.bfloat16)(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), y, atol=2e-2, rtol=2e-2)


def test_rope_cos_sin_values():
    cos, sin = rope_cos_sin(4, 4, 10000.0)
    # pair 0 has frequency 1, pair 1 has 1/100 (theta^(-2/4))
    assert cos[3].tolist() == pytest.approx([math.cos(3), math.cos(0.03)] * 2, rel=1e-6)
    assert sin[2].tolist() == pytest.approx([math.sin(2), math.sin(0.02)] * 2, rel=1e-6)


def test_rope_position_zero_is_identity_and_preserves_norm():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 32)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    rq, rk = rope(q, k, start_pos=0)
    torch.testing.assert_close(rq[:, :, 0], q[:, :, 0])
    torch.testing.assert_close(rk[:, :, 0], k[:, :, 0])
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1))
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(rq[:, :, 1:], q[:, :, 1:])


def test_rope_dot_product_depends_only_on_position_difference():
    torch.manual_seed(0)
    hd = 16
    rope = RotaryEmbedding(hd, 64, theta=10000.0)
    q = torch.randn(hd)
    k = torch.randn(hd)

    def score(m: int, n: int) -> float:
        rq, _ = rope(q.view(1, 1, 1, hd), q.view(1, 1, 1, hd), start_pos=m)
        _, rk = rope(k.view(1, 1, 1, hd), k.view(1, 1, 1, hd), start_pos=n)
        return float((rq * rk).sum())

    for m, n, shift in [(5, 2, 7), (3, 3, 20), (0, 9, 30), (10, 1, 40)]:
        assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-4)
    # ...and does change with the difference
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_rope_offsets_match_full_sequence():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 16)
    q = torch.randn(2, 3, 10, 8)
    full, _ = rope(q, q, start_pos=0)
    part, _ = rope(q[:, :, 6:], q[:, :, 6:], start_pos=6)
    torch.testing.assert_close(part, full[:, :, 6:])
    with pytest.raises(ValueError, match="max_seq_len"):
        rope(q, q, start_pos=7)


def test_rope_caches_survive_dtype_cast():
    rope = RotaryEmbedding(8, 16)
    rope.to(torch.bfloat16)
    cos, _ = rope.cos_sin(torch.device("cpu"))
    assert cos.dtype == torch.float32
    assert len(list(rope.state_dict())) == 0
