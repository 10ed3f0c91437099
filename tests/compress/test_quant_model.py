"""Quantizing whole models: the quantized bank against dense references, folders that load
bit for bit, under-calibrated experts, bad input, and the ``moelab quantize`` command."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from moelab.cli import app
from moelab.compress.quant import QuantizeConfig, collect_hessians, quantize_model, quantize_rtn
from moelab.core.dispatch import LocalDispatcher
from moelab.core.experts import ExpertBank, QuantizedExpertBank, QuantSpec
from moelab.core.experts.qformat import unpack_codes
from moelab.models import CheckpointError, load_model, save_model
from moelab.models.hooks import moe_layers

from ..cli_checks import cli_error

runner = CliRunner()


def _spec(**kw):
    base = dict(method="gptq", bits=4, group_size=4, act_order=True, lowrank="tileq", rank=3,
                grid=(2, 3))  # fmt: skip
    base.update(kw)
    return QuantSpec(**base)


def _quantized(make_model, make_batches, target=None, weighting=None, **kw):
    model = make_model()
    cfg = QuantizeConfig(spec=_spec(**kw), min_tokens=2, target=target, weighting=weighting)
    report = quantize_model(model, make_batches(4, 2, 8), cfg)
    return model, report


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"grid": (2, 4)},  # tileq with two empty cells
        {"grid": (2, 4), "act_order": False, "rotate_block": 4},  # + the rotated GPTQ
        {"lowrank": "tileq-core"},
        {"lowrank": "per-expert", "grid": None},
        {"lowrank": "per-expert", "grid": None, "target": "weight-once", "weighting": "awq"},
        {"lowrank": "shared-1d", "grid": None, "method": "rtn", "act_order": False, "bits": 3},
        {"lowrank": "none", "rank": 0, "grid": None, "bits": 2, "symmetric": True},
    ],
)
def test_quantized_bank_equals_a_dense_bank_of_its_effective_weights(make_model, make_batches, kw):
    model, report = _quantized(make_model, make_batches, **kw)
    layer = moe_layers(model)[0]
    bank = layer.experts
    assert isinstance(bank, QuantizedExpertBank)
    dense = ExpertBank(bank.config, bank.num_experts).double()
    with torch.no_grad():
        dense.w_gate_up.copy_(bank.w_in)
        dense.w_down.copy_(bank.w_down)
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 1, 4, 2, 1])
    x = torch.randn(int(counts.sum()), 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ref = dense(x, counts)
        got = bank(x, counts)
    assert float((got - ref).norm() / ref.norm()) <= 1e-12
    # the layer's single pass (gate/up projected once per token where the factors allow,
    # TileQ's down correction accumulated per token) == combine of rows
    x_T = torch.randn(10, 16, generator=g, dtype=torch.float64)
    plan = layer.router(x_T)
    disp = LocalDispatcher()
    d = disp.dispatch(x_T, plan)
    with torch.no_grad():
        want = disp.combine(dense(d.x, d.counts), d, 10)
        fused = bank.forward_combined(d, 10, disp.combine)
        per_token = bank.forward_combined(d, 10, disp.combine, x_T)
        via_layer = layer._experts(x_T, plan, want_acts=False)[0]
    for got in (fused, per_token, via_layer):
        assert float((got - want).norm() / want.norm()) <= 1e-12
    assert report.bits_per_param > kw.get("bits", 4)


@pytest.mark.parametrize("lowrank", ["tileq-core", "tileq"])
def test_bits_per_param_counts_codes_scales_zeros_gidx_and_factors(
    make_model, make_batches, lowrank
):
    _, report = _quantized(make_model, make_batches, lowrank=lowrank)
    E, D, Fh, g, r = 6, 16, 12, 4, 3
    per_layer = 0
    for I, O in ((D, Fh), (D, Fh), (Fh, D)):  # noqa: E741  gate, up, down: (in, out)
        n = E * O * I
        bits = n * 4 + (n // g) * (16 + 4) + E * I * 16  # codes, fp16 scales, 4-bit zeros, g_idx
        if lowrank == "tileq-core":
            bits += 16 * (2 * r * O + 3 * r * I + E * r * r)  # 2x3 factors + r x r cores
        else:  # 2 input-side and 3 output-side factors (Σ folded in) + E·I input un-scaling
            bits += 16 * (2 * r * I + 3 * r * O + E * I)
        per_layer += bits
    weights = 3 * E * D * Fh
    assert report.layers[0].weights == weights
    assert report.bits_per_param == pytest.approx(per_layer / weights)


@pytest.mark.parametrize("grid, rot", [((2, 3), 0), ((2, 4), 0), ((2, 4), 4)])
def test_saved_folder_loads_bit_for_bit_and_checksums_guard_it(
    make_model, make_batches, tmp_path, grid, rot
):
    kw = {"act_order": False, "rotate_block": rot} if rot else {}
    model, _ = _quantized(make_model, make_batches, grid=grid, **kw)
    ids = make_batches(1, 2, 8, seed=9)[0]
    with torch.no_grad():
        before = model(ids).logits
    save_model(model, tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization"]["spec"]["lowrank"] == "tileq"
    assert cfg["quantization"]["format_version"] == 2
    loaded = load_model(tmp_path / "q")
    assert isinstance(moe_layers(loaded)[0].experts, QuantizedExpertBank)
    want = moe_layers(model)[0].experts.projections["gate"].lowrank
    got = moe_layers(loaded)[0].experts.projections["gate"].lowrank
    for name in ("U", "V", "in_scale", "row_of", "col_of"):
        assert torch.equal(getattr(got, name), getattr(want, name))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
    data = bytearray((tmp_path / "q" / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "q" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_model(tmp_path / "q")


@pytest.mark.parametrize("method, rot", [("rtn", 0), ("gptq", 0), ("gptq", 4)])
def test_tileq_stores_the_quantized_residual_plus_the_kept_weight_fit(
    make_model, make_batches, method, rot
):
    """Stored layer == Q(W − L) + L exactly, with L the code-style fit of W itself (AWQ
    scales from each expert's own rows), not refitted to the quantization error."""
    from moelab.compress.quant import awq_scale, fit_lowrank
    from moelab.compress.quant.pipeline import _projection_weights

    model = make_model()
    batches = make_batches(4, 2, 8)
    weights = _projection_weights(moe_layers(model)[0].experts)
    hess = collect_hessians(model, batches)[0]
    spec = _spec(method=method, act_order=False, grid=(2, 4), rotate_block=rot)
    cfg = QuantizeConfig(spec=spec, min_tokens=2, sequential=False)
    assert (cfg.lowrank_target, cfg.lowrank_weighting) == ("weight-once", "awq")
    quantize_model(model, batches, cfg)
    bank = moe_layers(model)[0].experts
    for name, W in weights.items():
        proj = bank.projections[name]
        acc = hess.inter if name == "down" else hess.inputs
        L = copy.deepcopy(proj.lowrank).float().dense()  # as the pipeline computed it
        # L is the tileq fit of the fp weight (fp16-rounded as stored)
        f = fit_lowrank("tileq", W, awq_scale(acc.mean_abs(), acc.counts), 3, (2, 4),
                        per_expert_scale=True)  # fmt: skip
        torch.testing.assert_close(L, f.half().float().dense(), rtol=0, atol=2e-6)
        assert float(L.norm()) > 0.3 * float(W.norm())  # a fit of W, not of a small error
        if method == "rtn":  # the residual's codes are exactly RTN of W − L
            q = quantize_rtn(W - L, 4, 4)
            assert torch.equal(proj.unpacked_codes(), q.codes)
        deq = proj.dequantize(torch.float64)
        if rot:  # codes live in the rotated basis: Q(W − L) R_eᵀ is what dequantize gives
            from moelab.compress.quant import gptq_quantize
            from moelab.compress.quant.rotation import rotation_permutation
            from moelab.core.experts.rotation import rotate, rotate_hessian, unrotate

            H = acc.hessians()
            perm = rotation_permutation(W - L, H)
            assert torch.equal(proj.perm.long(), perm)
            q = gptq_quantize(rotate(W - L, perm, rot), rotate_hessian(H, perm, rot).float(), 4, 4)
            assert torch.equal(proj.unpacked_codes(), q.codes)  # GPTQ of the rotated residual
            torch.testing.assert_close(deq, unrotate(q.dequantize(torch.float64), perm, rot))
        L64 = proj.lowrank.dense().double()
        assert torch.equal(proj.weight(torch.float64), deq + L64)
        assert float((L64 - L.double()).abs().max()) < 1e-6
        assert float((deq + L64 - W.double()).norm()) < 0.1 * float(W.norm())


def test_under_calibrated_experts_get_weight_derived_scales(make_model, make_batches):
    model = make_model()
    fp_bank = moe_layers(model)[0].experts
    w_gate = fp_bank.w_gate_up.detach()[:, :, :12].transpose(1, 2).float()
    spec = _spec(lowrank="none", rank=0, grid=None)
    batches = make_batches(1, 1, 2)  # 2 tokens × top-2: most experts see 0 or 1 row
    hess = collect_hessians(model, batches)
    counts = hess[0].inputs.counts
    report = quantize_model(model, batches, QuantizeConfig(spec=spec, min_tokens=2))
    under = report.layers[0].under_calibrated
    assert under == (counts < 2).nonzero().flatten().tolist() and len(under) >= 4
    assert report.under_calibrated[0] == under
    proj = moe_layers(model)[0].experts.projections["gate"]
    rtn = quantize_rtn(w_gate, 4, 4)
    codes = unpack_codes(proj.codes, 4, proj.shape)
    for e in under:
        assert torch.equal(codes[e], rtn.codes[e])
        assert torch.equal(proj.scale_values[e], rtn.scales[e])
        assert torch.equal(proj.g_idx[e].long(), torch.arange(16) // 4)
    assert torch.isfinite(proj.dequantize()).all()


def test_bad_input_is_refused(make_model, make_batches):
    model = make_model()
    batches = make_batches(1)
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(bits=5)
    with pytest.raises(ValueError, match="grid: 4x4 does not factor the 6 experts"):
        quantize_model(
            model, batches, QuantizeConfig(spec=_spec(lowrank="tileq-core", grid=(4, 4)))
        )
    with pytest.raises(ValueError, match="grid: 2x2 has fewer cells than the 6 experts"):
        quantize_model(model, batches, QuantizeConfig(spec=_spec(grid=(2, 2))))
    with pytest.raises(ValueError, match="rotate_block: the rotation orders"):
        _spec(rotate_block=4)  # act-order on
    with pytest.raises(ValueError, match="rotate_block: must be a power of two"):
        quantize_model(model, batches, QuantizeConfig(spec=_spec(act_order=False, rotate_block=8)))
    with pytest.raises(ValueError, match="weighting: tileq needs a diagonal"):
        QuantizeConfig(spec=_spec(), weighting="full")
    with pytest.raises(ValueError, match="weighting: 'awq'"):
        QuantizeConfig(spec=_spec(lowrank="shared-1d", grid=None), weighting="awq")
    with pytest.raises(ValueError, match="rank: 13 exceeds"):
        quantize_model(model, batches, QuantizeConfig(spec=_spec(rank=13)))
    with pytest.raises(ValueError, match="group_size: 5 does not divide"):
        quantize_model(model, batches, QuantizeConfig(spec=_spec(group_size=5)))
    quantize_model(model, batches, QuantizeConfig(spec=_spec()))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, batches, QuantizeConfig(spec=_spec()))
    with pytest.raises(ValueError, match="act_order"):
        QuantizeConfig(spec=_spec(method="rtn"))


def test_router_is_untouched_and_first_layer_routing_kept(make_model, make_batches):
    model = make_model()
    ids = make_batches(1, 2, 8, seed=5)[0]
    router_w = moe_layers(model)[0].router.weight.detach().clone()
    with torch.no_grad():
        before = model(ids).plans[0].expert_idx
    quantize_model(model, make_batches(2), QuantizeConfig(spec=_spec(bits=8)))
    assert torch.equal(moe_layers(model)[0].router.weight, router_w)
    with torch.no_grad():
        after = model(ids).plans[0].expert_idx
    assert torch.equal(before, after)  # layer 0's input does not depend on any expert


# ---------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("rot", ["0", "16"])
def test_cli_quantizes_and_the_folder_evaluates(cli_model, tmp_path, rot):
    folder, text = cli_model
    out = tmp_path / "q"
    res = runner.invoke(app, ["quantize", str(folder), "--out", str(out), "--bits", "3",
                              "--group-size", "16", "--lowrank", "tileq", "--rank", "4",
                              "--rotate-block", rot,
                              "--calib-data", str(text), "--calib-tokens", "512",
                              "--seq-len", "32", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads((out / "quantize.json").read_text())
    assert report["spec"]["grid"] == [2, 2] and report["spec"]["bits"] == 3
    assert report["bits_per_param"] > 3
    assert (report["lowrank_target"], report["weighting"]) == ("weight-once", "awq")
    ev = runner.invoke(app, ["eval", str(out), "--data", str(text), "--tokens", "256", "--json"])
    assert ev.exit_code == 0, ev.output
    # quantizing a quantized folder is refused, nothing written
    again = tmp_path / "q2"
    msg = cli_error(runner.invoke(app, ["quantize", str(out), "--out", str(again),
                                   "--group-size", "16", "--calib-data", str(text)]))  # fmt: skip
    assert "already quantized" in msg and not again.exists()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--bits", "5"], "bits"),
        (["--lowrank", "tileq-core", "--grid", "3x3"], "grid: 3x3 does not factor"),
        (["--lowrank", "tileq", "--grid", "1x3"], "grid: 1x3 has fewer cells"),
        (["--rotate-block", "3"], "rotate_block: must be a power of two"),
        (["--lowrank", "per-expert", "--rank", "64"], "rank: 64 exceeds"),
        (["--group-size", "7"], "group_size"),
        (["--calib-tokens", "100000"], "calib"),
        (["--lowrank", "tileq", "--grid", "axb"], "grid"),
    ],
)
def test_cli_bad_input_one_line_exit_2_nothing_written(cli_model, tmp_path, flags, needle):
    folder, text = cli_model
    out = tmp_path / "q"
    base = ["quantize", str(folder), "--out", str(out), "--group-size", "16",
            "--calib-data", str(text), "--calib-tokens", "256", "--seq-len", "32"]  # fmt: skip
    # later flags win in typer: the bad value overrides the base one
    msg = cli_error(runner.invoke(app, base + flags))
    assert needle in msg
    assert not out.exists()


def test_quantized_model_generates_with_the_kv_cache_like_a_full_forward(make_model, make_batches):
    from moelab.serve.generate import generate_ids

    model, _ = _quantized(make_model, make_batches)
    prompt = [1, 5, 9]
    ids = list(generate_ids(model, prompt, max_new_tokens=6, temperature=0))
    assert len(ids) == 6
    seq = prompt[:]  # greedy decoding without the cache gives the same tokens
    for _ in range(6):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    assert ids == seq[len(prompt) :]
    bank = moe_layers(model)[0].experts
    x = torch.randn(5, 16, dtype=torch.float64)
    one = torch.zeros(6, dtype=torch.long)
    one[2] = 5
    torch.testing.assert_close(bank.expert_output(x, 2), bank(x, one))


@pytest.mark.parametrize(
    "experts", [{"activation": "geglu", "bias": True}, {"activation": "gelu"}, {"lora_rank": 2}]
)
def test_other_activations_biases_and_lora(experts, tmp_path):
    from moelab.core.config import ExpertsConfig, MoEConfig, RouterConfig
    from moelab.models import ModelConfig, MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=37, d_model=16, n_layers=1, n_heads=2, max_seq_len=32,
        moe=MoEConfig(router=RouterConfig(num_experts=4, top_k=2),
                      experts=ExpertsConfig(hidden_size=16, ffn_hidden_size=8, **experts)),
    )  # fmt: skip
    model = MoETransformer(cfg).double().eval()
    if experts.get("bias"):
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2 and p.shape[0] == 4:  # expert biases [E, width]
                    p.normal_()
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    spec = QuantSpec(method="gptq", bits=8, group_size=8, lowrank="per-expert", rank=2)
    if experts.get("lora_rank"):
        with pytest.raises(ValueError, match="merge-lora"):
            quantize_model(model, [ids], QuantizeConfig(spec=spec, min_tokens=1))
        return
    with torch.no_grad():
        before = model(ids).logits
    quantize_model(model, [ids], QuantizeConfig(spec=spec, min_tokens=1))
    bank = moe_layers(model)[0].experts
    assert bank.proj_names == (("gate", "up", "down") if experts["activation"] == "geglu"
                               else ("up", "down"))  # fmt: skip
    with torch.no_grad():
        after = model(ids).logits
    # 8 bits + compensation: the function is kept closely (biases kept exactly)
    assert float((after - before).abs().max()) < 0.05 * float(before.abs().max())
    save_model(model, tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "q")(ids).logits, after)


def test_version_1_folders_read_their_tileq_as_tileq_core():
    from moelab.models.quantized import read_quantization

    spec = _spec(lowrank="tileq-core").to_dict()
    spec["lowrank"] = "tileq"  # what a version-1 folder wrote for the cored form
    assert read_quantization({"format_version": 1, "spec": spec}, "x").lowrank == "tileq-core"
    assert read_quantization({"format_version": 2, "spec": spec}, "x").lowrank == "tileq"
    assert read_quantization({"format_version": 3, "spec": spec}, "x").lowrank == "tileq"
    assert read_quantization({"format_version": 4, "spec": spec}, "x").lowrank == "tileq"
    with pytest.raises(ValueError, match="format_version 5"):
        read_quantization({"format_version": 5, "spec": spec}, "x")
    vq = {"method": "gptvq", "bits": 2, "group_size": 4, "vq_dim": 1, "vq_rows": 1}
    with pytest.raises(ValueError, match="GPTVQ codebooks need quantization format_version 4"):
        read_quantization({"format_version": 3, "spec": vq}, "x")


def _zero_input_channel(model, channel=3):
    """Every MoE layer sees input channel ``channel`` exactly zero on every row (its pre-FFN
    norm weight is zeroed): AWQ's mean |x| of that channel is 0."""
    with torch.no_grad():
        for b in model.blocks:
            if b.is_moe:
                b.ffn_norm.weight[channel] = 0.0
    return model


@pytest.mark.parametrize(
    "kw",
    [
        {"lowrank": "tileq", "grid": (2, 3), "method": "rtn", "act_order": False},
        {"lowrank": "per-expert", "grid": None, "weighting": "awq"},
    ],
)
def test_awq_scales_survive_an_input_channel_that_is_always_zero(make_model, make_batches, kw):
    """A zero channel used to give AWQ scales spanning 1e15 and factors of 2e6 that overflow
    float16 (TileQ: a misleading code-range error; per-expert: NaN logits). With llm-awq's
    1e-4 floor the factors stay small and the logits finite and close to the dense model's."""
    kw = dict(kw)
    weighting = kw.pop("weighting", None)
    dense = _zero_input_channel(make_model())
    model = copy.deepcopy(dense)
    cfg = QuantizeConfig(spec=_spec(**kw), min_tokens=2, weighting=weighting)
    quantize_model(model, make_batches(4, 2, 8), cfg)
    for layer in moe_layers(model):
        for p in layer.experts.projections.values():
            assert p.lowrank.V.abs().max() < 1e3 and p.lowrank.U.abs().max() < 1e3
    ids = make_batches(1, 2, 8, seed=5)[0]
    with torch.no_grad():
        got, want = model(ids).logits, dense(ids).logits
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.5 * want.abs().max()


def test_factors_beyond_float16_and_nan_outputs_are_refused(make_model, make_batches):
    from moelab.compress.quant.pipeline import check_finite_outputs
    from moelab.core.experts.lowrank import LowRankFactors
    from moelab.core.experts.quantized import QuantizedProjection

    spec = QuantSpec(method="rtn", bits=4, group_size=4, lowrank="per-expert", rank=1)
    ar = torch.arange(2)
    big = LowRankFactors("per-expert", torch.ones(2, 4, 1), torch.full((2, 4, 1), 2e6), ar, ar)
    codes, scales = torch.zeros(2, 4, 4, dtype=torch.long), torch.ones(2, 4, 1)
    with pytest.raises(ValueError, match=r"lowrank: factor V: reaches 2e\+06, outside float16"):
        QuantizedProjection.from_codes(spec, codes, scales, codes[..., :1], None, big)
    model = make_model()
    quantize_model(model, make_batches(2, 2, 8), QuantizeConfig(spec=_spec(), min_tokens=2))
    check_finite_outputs(model, make_batches(1)[0])  # a sound model passes
    with torch.no_grad():
        moe_layers(model)[1].experts.projections["down"].lowrank.U.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"MoE layer 1's outputs are not finite"):
        check_finite_outputs(model, make_batches(1)[0])
