"""GPTVQ: the codebook format, the column loop against a plain one-expert reference, the
M-step against the dense normal equations, and the quantized bank / folder / CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.compress.quant import (
    QuantizeConfig,
    calibration_error,
    codebook_rows,
    gptq_quantize,
    gptvq_quantize,
    quantize_model,
)
from moelab.compress.quant.gptq import dampened, inverse_cholesky
from moelab.compress.quant.gptvq import (
    _fit_codebooks,
    _round_codebooks,
    _solve_codebooks,
)
from moelab.core.experts import ExpertBank, QuantizedExpertBank, QuantSpec
from moelab.core.experts.vqformat import vq_dequantize
from moelab.models import load_model, save_model
from moelab.models.hooks import moe_layers

from ..cli_checks import cli_error

runner = CliRunner()


def _problem(E=2, O=8, I=16, seed=0):  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(I, I, generator=g) * 0.3 + torch.eye(I)
    X = torch.randn(E, 256, I, generator=g) @ mix
    return torch.randn(E, O, I, generator=g), X.transpose(1, 2) @ X / 256


def test_dequantize_reads_each_vector_from_its_rows_and_columns_codebook():
    g = torch.Generator().manual_seed(1)
    E, O, I, d, R, gs, K = 2, 4, 8, 2, 2, 4, 4  # noqa: E741
    codes = torch.randint(0, K, (E, O, I // d), generator=g)
    codebook = torch.randint(-128, 128, (E, O // R, I // gs, K, d), generator=g).to(torch.int8)
    scales = torch.rand(E, O // R, I // gs, generator=g).to(torch.float16)
    got = vq_dequantize(codes, codebook, scales, R, gs)
    want = torch.empty(E, O, I)
    for e in range(E):
        for o in range(O):
            for v in range(I // d):
                blk = (e, o // R, v * d // gs)
                for t in range(d):
                    want[e, o, v * d + t] = (
                        float(scales[blk]) * codebook[blk][codes[e, o, v], t].item()
                    )
    assert torch.equal(got, want)


def _reference_loop(W, H, bits, d, gs, R, iters, blk):
    """One expert, column by column, in plain loops: fit the group's codebooks when its first
    column comes up — from the weights as they stood at the start of the lazy block of
    ``blk`` columns, the authors' ``find_params(W[:, col : col + g])`` — pick each row's
    nearest centroid under 1 / U_jj² weights, and push the error onto every later column
    through U at once (the lazy batching only defers those updates)."""
    O, I = W.shape  # noqa: E741
    K = 1 << (bits * d)
    U = inverse_cholesky(dampened(H.unsqueeze(0), 0.01))[0]
    imp = U.diagonal().pow(-2)
    W = W.clone()
    codes = torch.zeros(O, I // d, dtype=torch.long)
    books = {}
    for col in range(0, I, d):
        if col % blk == 0:
            snapshot = W.clone()
        if col % gs == 0:
            X = snapshot[None, :, col : col + gs]
            cb = _fit_codebooks(X, imp[None, col : col + gs], R, K, d, iters)
            _round_codebooks(cb)
            books[col // gs] = cb[0]
        for o in range(O):
            cb = books[col // gs][o // R]  # [K, d]
            w = W[o, col : col + d]
            k = int((((w - cb) ** 2) * imp[col : col + d]).sum(-1).argmin())
            codes[o, col // d] = k
            err = (w - cb[k]) / U.diagonal()[col : col + d]
            for t in range(d):
                W[o, col + d :] -= err[t] * U[col + t, col + d :]
    return codes


@pytest.mark.parametrize("bits, d, block", [(2, 2, 128), (3, 1, 128), (2, 2, 4)])
def test_batched_loop_equals_a_plain_one_expert_reference(bits, d, block):
    W, H = _problem()
    vq = gptvq_quantize(W, H, bits, d, 8, 4, block_size=block, kmeans_iters=20, m_step=False)
    blk = max(8, block // 8 * 8)
    for e in range(W.shape[0]):
        assert torch.equal(vq.codes[e], _reference_loop(W[e], H[e], bits, d, 8, 4, 20, blk))


def test_m_step_solves_the_normal_equations_and_never_raises_the_objective():
    W, H = _problem(E=1, O=4, I=8)
    vq = gptvq_quantize(W, H, 2, 1, 4, 2, kmeans_iters=10, m_step=False)
    x = _solve_codebooks(vq, W, H.double(), iters=64)  # [1, 2, 2, 4, 1]
    K, n = 4, 2 * 4  # per row block: 2 column groups × 4 centroids × d = 1
    for r in range(2):
        A = torch.zeros(n, n, dtype=torch.float64)
        b = torch.zeros(n, dtype=torch.float64)
        for o in range(2 * r, 2 * r + 2):
            P = torch.zeros(8, n, dtype=torch.float64)  # weight j reads coordinate u
            for j in range(8):
                P[j, (j // 4) * K + int(vq.codes[0, o, j])] = 1
            A += P.T @ H[0].double() @ P
            b += P.T @ H[0].double() @ W[0, o].double()
        used = A.diagonal() > 0
        sol = torch.linalg.lstsq(A[used][:, used], b[used]).solution
        got = x[0, r].reshape(-1).double()[used]
        assert torch.allclose(got, sol, rtol=1e-3, atol=1e-4)
    before = calibration_error(W, vq.dequantize(), H)
    after = calibration_error(W, gptvq_quantize(W, H, 2, 1, 4, 2, kmeans_iters=10).dequantize(), H)
    assert float(after) <= float(before)


def test_two_dimensional_codebooks_beat_scalar_gptq_at_two_bits():
    # the paper's central claim in miniature: at the same code bits, 2-D vectors with a
    # codebook fit the layer objective better than a uniform scalar grid
    W, H = _problem(E=2, O=64, I=64)
    vq = gptvq_quantize(W, H, 2, 2, 32, 32)
    sq = gptq_quantize(W, H, 2, 32)
    vq_err = calibration_error(W, vq.dequantize(), H).sum()
    sq_err = calibration_error(W, sq.dequantize(), H).sum()
    assert float(vq_err) < 0.8 * float(sq_err)


def test_codebook_rows_follow_the_authors_codebook_size():
    # 2 bits × 2 dims: K·d·8 bits / 0.125 = 2,048 weights = 32 rows of 64 columns
    assert codebook_rows(2, 2, 64, [576, 1536]) == 32
    assert codebook_rows(3, 2, 64, [576, 1536]) == 96  # 8,192 weights -> 128, nearest divisor
    with pytest.raises(ValueError, match="vq_rows"):
        codebook_rows(4, 2, 4, [6, 9])


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(vq_dim=3, vq_rows=4), "vq_dim"),
        (dict(vq_dim=4, vq_rows=4, bits=3), "bits"),
        (dict(vq_dim=2, vq_rows=1), "fewer than its 16 centroids"),
        (dict(vq_dim=1, vq_rows=4, symmetric=True), "symmetric"),
        (dict(method="gptq", vq_dim=2, vq_rows=4), "only gptvq"),
    ],
)
def test_spec_refuses_bad_vector_settings(kw, needle):
    base = dict(method="gptvq", bits=2, group_size=4)
    with pytest.raises(ValueError, match=needle):
        QuantSpec(**{**base, **kw})


def _vq_model(make_model, make_batches, **kw):
    spec = QuantSpec(method="gptvq", bits=3, group_size=4, vq_dim=1, vq_rows=4, **kw)
    model = make_model()
    report = quantize_model(model, make_batches(4, 2, 8), QuantizeConfig(spec=spec, min_tokens=2))
    return model, report


@pytest.mark.parametrize("kw", [{}, {"lowrank": "per-expert", "rank": 2}, {"rotate_block": 4}])
def test_vq_bank_equals_a_dense_bank_and_counts_its_bytes(make_model, make_batches, kw):
    model, report = _vq_model(make_model, make_batches, **kw)
    bank = moe_layers(model)[0].experts
    assert isinstance(bank, QuantizedExpertBank)
    dense = ExpertBank(bank.config, bank.num_experts).double()
    with torch.no_grad():
        dense.w_gate_up.copy_(bank.w_in)
        dense.w_down.copy_(bank.w_down)
    counts = torch.tensor([3, 0, 1, 4, 2, 1])
    x = torch.randn(int(counts.sum()), 16, generator=torch.Generator().manual_seed(0)).double()
    with torch.no_grad():
        ref, got = dense(x, counts), bank(x, counts)
    assert float((got - ref).norm() / ref.norm()) <= 1e-12
    if not kw:
        E, D, Fh, K = 6, 16, 12, 8
        bits = 0
        for I, O in ((D, Fh), (D, Fh), (Fh, D)):  # noqa: E741
            blocks = E * (O // 4) * (I // 4)
            bits += E * O * I * 3 + blocks * (K * 8 + 16)  # codes, int8 centroids, fp16 scale
        assert report.bits_per_param == pytest.approx(bits / (3 * E * D * Fh))


def test_vq_folder_loads_bit_for_bit(make_model, make_batches, tmp_path):
    model, _ = _vq_model(make_model, make_batches)
    ids = make_batches(1, 2, 8, seed=9)[0]
    with torch.no_grad():
        before = model(ids).logits
    save_model(model, tmp_path / "q")
    quant = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert quant["format_version"] == 4 and quant["spec"]["vq_rows"] == 4
    loaded = load_model(tmp_path / "q")
    proj = moe_layers(loaded)[0].experts.projections["down"]
    assert proj.codebook.dtype == torch.int8 and proj.zeros is None
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)


def test_under_calibrated_experts_get_codebooks_of_their_weights(make_model, make_batches):
    spec = QuantSpec(method="gptvq", bits=3, group_size=4, vq_dim=1, vq_rows=4)
    model = make_model()
    W = moe_layers(model)[0].experts.w_down.detach().float().transpose(1, 2).clone()
    report = quantize_model(model, make_batches(1, 1, 2), QuantizeConfig(spec=spec, min_tokens=10))
    under = report.layers[0].under_calibrated
    assert under  # 2 tokens × top-2 cannot reach 10 rows for any expert
    e = under[0]
    eye = torch.eye(W.shape[2]).expand(W.shape[0], -1, -1)
    want = gptvq_quantize(W[e : e + 1], eye[:1], 3, 1, 4, 4).dequantize()[0]
    got = moe_layers(model)[0].experts.projections["down"].dequantize()[e]
    assert torch.allclose(got, want)


def test_cli_gptvq_picks_rows_and_refuses_bad_settings(cli_model, tmp_path):
    folder, text = cli_model
    out = tmp_path / "q"
    base = ["quantize", str(folder), "--group-size", "16", "--calib-data", str(text),
            "--calib-tokens", "256", "--seq-len", "32", "--method", "gptvq"]  # fmt: skip
    res = runner.invoke(app, [*base, "--out", str(out), "--bits", "2", "--vq-dim", "2", "--json"])
    assert res.exit_code == 0, res.output
    spec = json.loads((out / "quantize.json").read_text())["spec"]
    assert (spec["method"], spec["vq_dim"], spec["act_order"]) == ("gptvq", 2, False)
    assert spec["vq_rows"] == codebook_rows(2, 2, 16, [32, 64])
    bad = tmp_path / "bad"
    msg = cli_error(runner.invoke(app, [*base, "--out", str(bad), "--vq-dim", "3"]))
    assert "vq_dim" in msg and not bad.exists()
