"""Quantizers, packing, Hessians, low-rank fits and the fused path (real values)."""

# ruff: noqa: E741  (O and I are the output / input widths, as in the docstrings)

from __future__ import annotations

import itertools

import pytest
import torch

from moelab.compress.quant import (
    HessianAccumulator,
    activation_whitening,
    awq_scale,
    calibration_error,
    fit_lowrank,
    fit_tileq,
    fit_tileq_core,
    gptq_quantize,
    lowrank_extra_params,
    quantize_rtn,
    tileq_placement,
)
from moelab.compress.quant.assignment import min_cost_assignment
from moelab.compress.quant.bicluster import grid_assignment, kmeans, ring_placement
from moelab.compress.quant.rtn import group_params, quantize_values
from moelab.core.experts.lowrank import LowRankFactors, expert_of_rows
from moelab.core.experts.qformat import pack_codes, packed_size, unpack_codes


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_packing_round_trips_exactly(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (n,), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(n, bits)
    assert packed.numel() == (n if bits == 8 else -(-n // 8) * bits)
    assert torch.equal(unpack_codes(packed, bits, (n,)), codes)


def test_packing_layout_is_little_endian_bits():
    # codes 1,2,3,0,... at 2 bits: byte 0 = 1 | 2<<2 | 3<<4 | 0<<6 = 57
    codes = torch.tensor([1, 2, 3, 0, 3, 3, 3, 3])
    assert pack_codes(codes, 2).tolist() == [57, 255]
    # 3 bits: 8 codes of 7 -> 24 one-bits
    assert pack_codes(torch.full((8,), 7), 3).tolist() == [255, 255, 255]


def test_packing_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(8, dtype=torch.long), 9)
    with pytest.raises(ValueError, match="values must be in"):
        pack_codes(torch.tensor([4]), 2)
    with pytest.raises(ValueError, match="packed"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 2, (16,))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_error_within_half_a_step(bits, symmetric):
    g = torch.Generator().manual_seed(bits)
    W = torch.randn(3, 16, 64, generator=g) * torch.logspace(-3, 1, 64)
    W[0, 0, :16] = 0.0  # an all-zero group
    q = quantize_rtn(W, bits, 16, symmetric)
    assert q.codes.min() >= 0 and q.codes.max() <= (1 << bits) - 1
    step = q.scales.float().repeat_interleave(16, dim=-1)
    err = (W - q.dequantize()).abs()
    assert (err <= step / 2 + 1e-6 * W.abs() + 1e-7).all()
    assert torch.equal(q.dequantize()[0, 0, :16], torch.zeros(16))


def test_rtn_hand_computed():
    # asymmetric 2 bits, range [0, 3] -> scale 1 (rounded up to fp16), zero 0
    W = torch.tensor([[[0.0, 1.2, 2.6, 3.0]]])
    q = quantize_rtn(W, 2, 4)
    assert q.codes.tolist() == [[[0, 1, 3, 3]]]
    assert q.zeros.tolist() == [[[0]]]
    assert abs(float(q.scales) - 1.0) < 2e-3


def _calib(E=3, I=48, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(I, I, generator=g) / I**0.5 + torch.eye(I)
    X = torch.randn(E, n, I, generator=g) @ mix
    X[..., :4] *= 5  # a few strong features
    return X, 2 * X.transpose(1, 2) @ X / n


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_calibration_error_not_above_rtn(bits, act_order):
    _, H = _calib()
    W = torch.randn(3, 32, 48, generator=torch.Generator().manual_seed(5))
    q = gptq_quantize(W, H, bits, 16, act_order=act_order)
    r = quantize_rtn(W, bits, 16)
    eq, er = calibration_error(W, q.dequantize(), H), calibration_error(W, r.dequantize(), H)
    assert (eq <= er).all()
    assert float(eq.sum()) < 0.8 * float(er.sum())
    if act_order:
        assert q.g_idx is not None and q.g_idx.shape == (3, 48)
        assert torch.equal(torch.bincount(q.g_idx[0], minlength=3), torch.tensor([16, 16, 16]))


def test_gptq_first_column_is_rtn_and_identity_hessian_gives_rtn():
    W = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    H = torch.eye(32).expand(2, 32, 32).clone()
    # with H = I the error feedback is zero (H⁻¹ diagonal): GPTQ == RTN exactly
    q = gptq_quantize(W, H, 3, 8, damp=0.01)
    r = quantize_rtn(W, 3, 8)
    assert torch.equal(q.codes, r.codes)


def _reference_gptq_codes(W, H, bits, g, blk, damp=0.01):
    """One expert [O, I] as the reference loop (IST-DASLab gptq.py) runs it, without
    act-order: a group's scale from ``W`` as the earlier blocks left it."""
    O, I = W.shape
    W = W.clone()
    H = H.double().clone()
    H += damp * torch.diagonal(H).mean() * torch.eye(I, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    U = U.float()
    Q = torch.zeros(O, I)
    for i1 in range(0, I, blk):
        i2 = min(i1 + blk, I)
        W1, Err1 = W[:, i1:i2].clone(), torch.zeros(O, i2 - i1)
        for i in range(i2 - i1):
            if (i1 + i) % g == 0:
                s, z = group_params(W[None, :, i1 + i : i1 + i + g], bits, False)
                s, z = s[0].float(), z[0]
            q = quantize_values(W1[:, i], s, z, bits)
            Q[:, i1 + i] = q
            err = (W1[:, i] - s * (q - z)) / U[i1 + i, i1 + i]
            W1[:, i:] -= err[:, None] * U[i1 + i, i1 + i : i2][None]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q.long()


def test_gptq_group_scales_follow_the_reference_loop():
    """Groups of 8 inside blocks of 32: the default reads a group's scale as the reference
    does and gives its codes for every expert; the "updated" rule gives other codes, and the
    two rules agree when every group starts a block."""
    _, H = _calib(E=2, I=64)
    W = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(7))
    q = gptq_quantize(W, H, 2, 8, block_size=32)
    for e in range(2):
        assert torch.equal(q.codes[e], _reference_gptq_codes(W[e], H[e], 2, 8, 32))
    updated = gptq_quantize(W, H, 2, 8, block_size=32, group_stats="updated")
    assert not torch.equal(updated.codes, q.codes)
    aligned = gptq_quantize(W, H, 2, 8, block_size=8)
    aligned_updated = gptq_quantize(W, H, 2, 8, block_size=8, group_stats="updated")
    assert torch.equal(aligned.codes, aligned_updated.codes)
    with pytest.raises(ValueError, match="group_stats: must be reference or updated"):
        gptq_quantize(W, H, 2, 8, group_stats="stale")


def test_gptq_rejects_bad_arguments():
    W, H = torch.zeros(1, 4, 8), torch.eye(8)[None]
    with pytest.raises(ValueError, match="group_size"):
        gptq_quantize(W, H, 4, 3)
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(W, H, 4, 8, damp=0)
    with pytest.raises(ValueError, match="bits"):
        gptq_quantize(W, H, 5, 8)


def test_streamed_hessian_equals_stacked_including_one_token_batches():
    g = torch.Generator().manual_seed(0)
    E, I = 4, 6
    acc = HessianAccumulator(E, I)
    xs, es = [], []
    # batches with one token, an empty expert, a single row for one expert
    for counts in ([1, 0, 0, 0], [0, 0, 0, 1], [3, 0, 2, 1], [0, 1, 0, 0], [2, 2, 2, 2]):
        c = torch.tensor(counts)
        x = torch.randn(int(c.sum()), I, generator=g)
        acc.add(x, c)
        xs.append(x)
        es.append(expert_of_rows(c))
    x, e = torch.cat(xs).double(), torch.cat(es)
    H = acc.hessians()
    for k in range(E):
        rows = x[e == k]
        n = rows.shape[0]
        assert int(acc.counts[k]) == n
        torch.testing.assert_close(H[k], 2 * rows.T @ rows / n, rtol=1e-12, atol=1e-12)
    assert int(acc.counts.sum()) == x.shape[0]
    torch.testing.assert_close(acc.pooled(), 2 * x.T @ x / x.shape[0], rtol=1e-12, atol=1e-12)
    empty = HessianAccumulator(2, 3)
    empty.add(torch.zeros(0, 3), torch.zeros(2, dtype=torch.long))
    assert torch.equal(empty.hessians(), torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="sum"):
        acc.add(torch.zeros(2, I), torch.tensor([1, 0, 0, 0]))


def test_hungarian_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 4, 6):
        for _ in range(5):
            c = torch.randint(0, 4, (n, n), generator=g).double()
            p = min_cost_assignment(c)
            best = min(sum(c[i, q[i]] for i in range(n)) for q in itertools.permutations(range(n)))
            assert sorted(p.tolist()) == list(range(n))
            assert abs(float(sum(c[i, p[i]] for i in range(n))) - float(best)) < 1e-9


def _planted(K=16, O=40, I=24, r=3, noise=0.05, seed=0):
    """Experts whose errors share left factors by hidden row and right factors by column."""
    g = torch.Generator().manual_seed(seed)
    M = N = int(K**0.5)
    Us = torch.linalg.qr(torch.randn(M, O, r, generator=g)).Q
    Vs = torch.linalg.qr(torch.randn(N, I, r, generator=g)).Q
    T = torch.stack([Us[e // N] @ torch.randn(r, r, generator=g) @ Vs[e % N].T for e in range(K)])
    T = T + noise * torch.randn(K, O, I, generator=g)
    perm = torch.randperm(K, generator=g)
    return T[perm], perm


def test_biclustering_recovers_a_planted_grid():
    T, perm = _planted()
    U, _, Vh = torch.linalg.svd(T, full_matrices=False)
    row_of, col_of, _ = grid_assignment(U[:, :, :3], Vh[:, :3].transpose(1, 2), (4, 4))
    hidden_row = perm // 4
    hidden_col = perm % 4
    # same hidden row <=> same assigned row (up to relabelling); likewise columns
    assert torch.equal(hidden_row[:, None] == hidden_row, row_of[:, None] == row_of)
    assert torch.equal(hidden_col[:, None] == hidden_col, col_of[:, None] == col_of)
    assert torch.equal(torch.sort(row_of * 4 + col_of).values, torch.arange(16))


def test_tileq_core_fits_a_planted_grid_and_refinement_does_not_hurt():
    T, _ = _planted(noise=0.02)
    d = torch.rand(24, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    _, c0 = fit_tileq_core(T, d, 3, (4, 4), sweeps=0)
    f2, c2 = fit_tileq_core(T, d, 3, (4, 4), sweeps=2)
    assert c2 >= c0 - 1e-9 and c2 > 0.95
    res = ((T - f2.dense()) * d.float()).norm() / (T * d.float()).norm()
    assert res < 0.2


@pytest.mark.parametrize("scheme", ["per-expert", "shared-1d", "tileq-core", "tileq"])
def test_extra_memory_matches_formula(scheme):
    K, O, I, r = 16, 40, 24, 4
    T = torch.randn(K, O, I, generator=torch.Generator().manual_seed(0))
    f = fit_lowrank(scheme, T, torch.ones(I, dtype=torch.float64), r, (4, 4))
    formula = {
        "per-expert": K * r * (I + O),
        "shared-1d": r * I + K * r * O,
        "tileq-core": 4 * r * O + 4 * r * I + K * r * r,
        "tileq": r * (4 * I + 4 * O) + K * I,  # factors + per-expert input un-scaling
    }[scheme]
    assert f.extra_params() == formula == lowrank_extra_params(scheme, K, I, O, r, (4, 4))


def test_per_expert_fit_is_the_weighted_truncated_svd():
    T = torch.randn(2, 10, 6, generator=torch.Generator().manual_seed(0))
    d = torch.linspace(0.5, 2, 6, dtype=torch.float64)
    f = fit_lowrank("per-expert", T, d, 2)
    for e in range(2):
        A = T[e].double() * d
        s = torch.linalg.svdvals(A)
        got = ((T[e].double() - f.delta(e).double()) * d).norm()
        assert abs(float(got) - float(s[2:].norm())) < 1e-4  # Eckart-Young optimum


def test_full_whitening_fit_minimises_the_output_error():
    g = torch.Generator().manual_seed(2)
    X = (
        torch.randn(300, 6, generator=g, dtype=torch.float64)
        @ torch.randn(6, 6, generator=g).double()
    )
    H = X.T @ X / 300
    S = activation_whitening(H, damp=0.01)
    Hd = H + 0.01 * torch.diagonal(H).mean() * torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(S @ S, Hd)
    T = torch.randn(2, 10, 6, generator=g)
    f = fit_lowrank("per-expert", T, S, 2)
    for e in range(2):
        s = torch.linalg.svdvals(T[e].double() @ S)
        dW = T[e].double() - f.delta(e).double()
        err = torch.sqrt(torch.trace(dW @ Hd @ dW.T))
        assert abs(float(err) - float(s[2:].norm())) < 1e-4  # optimum of the output error


@pytest.mark.parametrize("weighting", ["diag", "full"])
@pytest.mark.parametrize("scheme", ["per-expert", "shared-1d", "tileq-core", "tileq"])
def test_fused_low_rank_path_equals_per_expert_reference(scheme, weighting):
    g = torch.Generator().manual_seed(1)
    K, O, I, r = 16, 20, 12, 3
    T = torch.randn(K, O, I, generator=g)
    if weighting == "diag":
        d = torch.rand(I, generator=g).double() + 0.5
    else:
        X = torch.randn(50, I, generator=g, dtype=torch.float64)
        d = activation_whitening(X.T @ X)
    if scheme == "tileq" and weighting == "full":  # tileq: per-expert AWQ-style scales instead
        d = torch.rand(K, I, generator=g).double() + 0.5
        f = fit_lowrank(scheme, T, d, r, (4, 4), per_expert_scale=True)
        assert f.in_scale is not None and not torch.equal(f.in_scale[0], f.in_scale[1])
    else:
        f = fit_lowrank(scheme, T, d, r, (4, 4))
    f = f.double()  # float64 factors: every path agrees to rounding
    counts = torch.tensor([3, 0, 1, 5, 2, 0, 0, 4, 1, 1, 7, 2, 0, 3, 1, 2])
    n_rows = int(counts.sum())
    T_tok = 9
    x_T = torch.randn(T_tok, I, generator=g, dtype=torch.float64)
    token_idx = torch.randint(0, T_tok, (n_rows,), generator=g)
    x = x_T[token_idx]
    experts = expert_of_rows(counts)
    ref = torch.stack([f.delta(int(e)).double() @ x[i] for i, e in enumerate(experts)])
    # the once-per-token projection exactly where the column factors are shared and plain
    assert f.projects_tokens == (scheme in ("shared-1d", "tileq-core"))
    for got in (f.apply_rows(x, counts), f.apply_rows(x, counts, x_T, token_idx),
                f.apply_loop(x, counts)):  # fmt: skip
        assert float((got - ref).norm() / ref.norm()) <= 1e-12
    # token form: routing-weighted accumulation per token (the TileQ schemes' down path)
    assert f.accumulates_tokens == scheme.startswith("tileq")
    w = torch.rand(n_rows, generator=g, dtype=torch.float64)
    want = torch.zeros(T_tok, O, dtype=torch.float64).index_add(0, token_idx, w[:, None] * ref)
    got = f.apply_tokens(x, counts, token_idx, w, T_tok)
    assert got.dtype == torch.float64
    assert float((got - want).norm() / want.norm()) <= 1e-12


def test_factor_grid_validation():
    U, V = torch.zeros(2, 4, 1), torch.zeros(2, 3, 1)
    with pytest.raises(ValueError, match="share one grid cell"):
        LowRankFactors(
            "tileq-core", U, V, torch.tensor([0, 0]), torch.tensor([1, 1]), torch.zeros(2, 1, 1)
        )
    with pytest.raises(ValueError, match="in_scale"):
        LowRankFactors("tileq", U, V, torch.tensor([0, 1]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="grid"):
        fit_tileq_core(torch.zeros(6, 4, 3), torch.ones(3, dtype=torch.float64), 1, (4, 4))
    with pytest.raises(ValueError, match="fewer cells"):
        fit_tileq(torch.zeros(6, 4, 3), torch.ones(6, 3), 1, (2, 2))
    with pytest.raises(ValueError, match="scales"):
        fit_tileq(torch.zeros(4, 4, 3), torch.zeros(4, 3), 1, (2, 2))
    with pytest.raises(ValueError, match="rank"):
        fit_lowrank("per-expert", torch.zeros(2, 4, 3), torch.ones(3, dtype=torch.float64), 4)


# ------------------------------------------------------- TileQ as the authors' code does it
def _orth(n, d, r, g):
    return torch.linalg.qr(torch.randn(n, d, r, generator=g, dtype=torch.float64)).Q


def _planted_code_grid(cells, M, N, I=6, O=8, r=3, seed=0):
    """Experts whose *scaled* weights ``B_e = diag(s_e) W_eᵀ = P_m Σ Q_nᵀ`` share input-side
    bases ``P_m`` by grid row, output-side bases ``Q_n`` by column and one Σ."""
    g = torch.Generator().manual_seed(seed)
    P, Q = _orth(M, I, r, g), _orth(N, O, r, g)
    sigma = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)[:r]
    s = torch.rand(len(cells), I, generator=g, dtype=torch.float64) + 0.5
    W = torch.stack([((P[m] * sigma) @ Q[n].T / s[e, :, None]).T for e, (m, n) in enumerate(cells)])
    return W, s


def test_tileq_full_rank_reconstructs_every_expert_exactly_with_empty_cells():
    g = torch.Generator().manual_seed(4)
    K, O, I = 7, 5, 4
    W = torch.randn(K, O, I, generator=g, dtype=torch.float64)
    s = torch.rand(K, I, generator=g, dtype=torch.float64) + 0.5
    f, captured = fit_tileq(W, s, min(2 * I, 4 * O), (2, 4))  # 8 cells, one empty
    assert f.S is None and f.U.shape == (4, O, 8) and f.V.shape == (2, I, 8)
    assert captured == pytest.approx(1.0)
    for e in range(K):
        assert float((f.delta(e) - W[e]).abs().max()) < 1e-12
    # lower rank: strictly worse, so the test above can fail
    f2, c2 = fit_tileq(W, s, 3, (2, 4))
    assert c2 < 0.99 and float((f2.dense() - W).abs().max()) > 1e-3


def test_tileq_shared_sigma_reproduces_experts_with_shared_subspaces():
    M, N = 2, 4
    hidden = [(m, n) for m in range(M) for n in range(N)]
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1)).tolist()
    W, s = _planted_code_grid([hidden[p] for p in perm], M, N)
    f, captured = fit_tileq(W, s, 3, (M, N))
    rel = (f.dense() - W).norm(dim=(1, 2)) / W.norm(dim=(1, 2))
    assert float(rel.max()) < 1e-6 and captured == pytest.approx(1.0)
    assert f.S is None and f.extra_params() == 3 * (M * 6 + N * 8) + 8 * 6
    # one SVD, one Σ: a rank-2 fit loses exactly the third singular value's share
    _, c2 = fit_tileq(W, s, 2, (M, N))
    assert c2 == pytest.approx((9 + 4) / 14)


def test_tileq_placement_groups_shared_subspaces_and_leaves_cells_empty():
    M, N = 2, 4
    cells = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]  # K = 7 < 8 cells
    order = [5, 2, 0, 6, 3, 1, 4]
    hidden = [cells[i] for i in order]
    W, s = _planted_code_grid(hidden, M, N, seed=3)
    B = s.unsqueeze(-1) * W.transpose(1, 2)
    row, col = tileq_placement(B, (M, N), 6, seed=0)
    hr = torch.tensor([c[0] for c in hidden])
    hc = torch.tensor([c[1] for c in hidden])
    assert torch.equal(hr[:, None] == hr, row[:, None] == row)
    assert torch.equal(hc[:, None] == hc, col[:, None] == col)
    assert (row * N + col).unique().numel() == 7  # distinct cells, one left empty
    again = tileq_placement(B, (M, N), 6, seed=0)
    assert torch.equal(again[0], row) and torch.equal(again[1], col)
    f, _ = fit_tileq(W, s, 3, (M, N))
    assert torch.equal(f.col_of, row) and torch.equal(f.row_of, col)


def test_ring_placement_follows_the_code():
    # two experts want cell (0, 0): the second takes the first free cell of ring 1,
    # dr = -1 first (wrapping to the last row)
    row, col = ring_placement(torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1]), (3, 3))
    assert row.tolist() == [0, 2, 1] and col.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="fewer cells"):
        ring_placement(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), (2, 2))


def test_awq_scale_hand_computed():
    m = torch.tensor(
        [[1.0, 2.0, 4.0], [1e-3, 1.0, 1.0], [5.0, 5.0, 5.0], [0.0, 1.0, 2.0], [0.0, 30.0, 30.0]],
        dtype=torch.float64,
    )
    s = awq_scale(m, torch.tensor([3, 3, 0, 3, 3]))
    f = m[0] ** 2.4
    torch.testing.assert_close(s[0], f / torch.sqrt(f.max() * f.min()))
    # (1e-3)^2.4 is floored at 1e-4 (llm-awq's clamp): ratio 1e4 < 1e5 at p = 2.4
    torch.testing.assert_close(s[1], torch.tensor([1e-2, 1e2, 1e2], dtype=torch.float64))
    assert torch.equal(s[2], torch.ones(3, dtype=torch.float64))  # no rows: ones
    # a channel that is zero on every row: floored at 1e-4, not 1e-15 (no 1e15 span)
    f = torch.tensor([1e-4, 1.0, 2.0**2.4], dtype=torch.float64)
    torch.testing.assert_close(s[3], f / torch.sqrt(f.max() * 1e-4))
    # 30^p / 1e-4 >= 1e5 until p = 0.6 (30^0.6 = 7.7): 1/s stays below sqrt(7.7e4) = 278
    f = torch.tensor([1e-4, 30**0.6, 30**0.6], dtype=torch.float64)
    torch.testing.assert_close(s[4], f / torch.sqrt(f.max() * 1e-4))
    assert 277 < float(1 / s[4].min()) < 278


def test_kmeans_is_seeded_and_separates_clusters():
    g = torch.Generator().manual_seed(0)
    X = torch.cat([torch.randn(5, 3, generator=g) * 0.01 + c for c in (0.0, 5.0, -5.0)])
    lab = kmeans(X, 3, seed=1)
    assert lab.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert torch.equal(kmeans(X, 3, seed=1), lab)


# ------------------------------------------------- the authors' rotation before GPTQ
def _code_rotation(perm, I, b):
    """The code's matrices: ``Ppermute`` (column j = e_{perm[j]}) and ``diagI_rot`` (identity
    on the first b columns, block Walsh-Hadamard on the rest), built as hadamard_utils does."""
    P = torch.zeros(I, I, dtype=torch.float64)
    P[perm, torch.arange(I)] = 1.0
    Hb = torch.tensor([[1.0]], dtype=torch.float64)
    while Hb.shape[0] < b:
        Hb = torch.cat([torch.cat([Hb, Hb], 1), torch.cat([Hb, -Hb], 1)], 0)
    rot = torch.block_diag(*[Hb / b**0.5] * (I // b))
    D = torch.zeros(I, I, dtype=torch.float64)
    D[:b, :b] = torch.eye(b, dtype=torch.float64)
    D[b:, b:] = rot[b:, b:]
    return P @ D


def test_rotation_matches_the_code_matrices_and_inverts():
    from moelab.core.experts.rotation import rotate, rotate_hessian, unrotate

    g = torch.Generator().manual_seed(0)
    E, O, I, b = 2, 5, 12, 4
    X = torch.randn(E, O, I, generator=g, dtype=torch.float64)
    perm = torch.stack([torch.randperm(I, generator=g) for _ in range(E)])
    R = torch.stack([_code_rotation(perm[e], I, b) for e in range(E)])
    torch.testing.assert_close(R[0].T @ R[0], torch.eye(I, dtype=torch.float64))
    torch.testing.assert_close(rotate(X, perm, b), X @ R)
    torch.testing.assert_close(unrotate(rotate(X, perm, b), perm, b), X)
    A = torch.randn(E, I, I, generator=g, dtype=torch.float64)
    H = A @ A.transpose(1, 2)
    torch.testing.assert_close(rotate_hessian(H, perm, b), R.transpose(1, 2) @ H @ R)


def test_rotation_permutation_hand_computed():
    from moelab.compress.quant.rotation import rotation_permutation

    res = torch.tensor([[[4.0, 1.0, 2.0, 2.0]]])  # mean |res| per column (one row)
    H = torch.diag(torch.tensor([1.0, 1.0, 2.0, 4.0]))[None]  # log2 diag: 0, 0, 1, 2
    # score = mean|res| / (log2 H − min + 1) = 4, 1, 1, 2/3 -> increasing: 3, 1, 2, 0
    assert rotation_permutation(res, H).tolist() == [[3, 1, 2, 0]]


@pytest.mark.parametrize(
    ("bits", "shape", "symmetric"),
    [(8, (4, 3, 5), True), (4, (4, 4, 6), False), (3, (4, 3, 5), False), (2, (4, 2, 4), True)],
)
def test_dequantizing_some_experts_equals_slicing_all(bits, shape, symmetric):
    """Per-expert byte slicing (whole bytes per expert) and the unpack-all fallback (3 bits,
    15 codes per expert) both give the rows of the full dequantization, bit for bit."""
    from moelab.core.experts.quantized import QuantizedProjection, QuantSpec

    E, O, I = shape
    g = torch.Generator().manual_seed(bits)
    spec = QuantSpec(method="rtn", bits=bits, group_size=I, symmetric=symmetric,
                     act_order=False, lowrank="none", rank=0)  # fmt: skip
    codes = torch.randint(0, 1 << bits, shape, generator=g)
    zeros = None if symmetric else torch.randint(0, 1 << bits, (E, O, 1), generator=g)
    scales = torch.rand(E, O, 1, generator=g) + 0.5
    proj = QuantizedProjection.from_codes(spec, codes, scales, zeros, None, None)
    full = proj.dequantize()
    zero = zeros if zeros is not None else torch.full((E, O, 1), 1 << (bits - 1))
    assert torch.equal(full, scales.half().float() * (codes - zero))  # Ŵ = s · (q − z)
    for experts in ([2], [0, 3], [1, 2, 3]):
        idx = torch.tensor(experts)
        assert torch.equal(proj.dequantize(experts=idx), full[idx])
    assert torch.equal(unpack_codes(proj.codes, bits, shape, torch.uint8), codes.to(torch.uint8))
