"""Quantized dense projections (``moelab quantize --dense-bits``): the codes against the float
weights, the kernel against the dequantized matrix, folders that load bit for bit with a tied
head untied, bad input, and exports that refuse quantized weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from moelab.cli import app
from moelab.compress.quant import QuantizeConfig, quantize_model
from moelab.compress.quant.dense import quantize_dense
from moelab.core.experts import QuantSpec, cpu_kernel
from moelab.core.experts.quantized import KERNEL_MAX_ROWS
from moelab.interop.errors import UnsupportedConfigError
from moelab.interop.hf import hf_state
from moelab.models import CheckpointError, MoETransformer, load_model, save_model
from moelab.models.hooks import moe_layers
from moelab.models.quantized_linear import QuantizedLinear

from ..cli_checks import cli_error
from .conftest import tiny_model

runner = CliRunner()
needs_kernel = pytest.mark.skipif(cpu_kernel.kernel() is None, reason="no C++ toolchain")


def _experts_and_dense(make_batches, bits=8, group=4, tie=False):
    model = tiny_model()
    if tie:
        torch.manual_seed(0)
        cfg = dataclasses.replace(model.cfg, tie_embeddings=True)
        model = MoETransformer(cfg).double().eval()
    spec = QuantSpec(method="rtn", bits=8, group_size=group, symmetric=True)
    quantize_model(model, make_batches(2), QuantizeConfig(spec=spec, sequential=False))
    float_weights = {n: m.weight.detach().clone() for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)}  # fmt: skip
    report = quantize_dense(model, bits, group)
    return model, report, float_weights


@pytest.mark.parametrize("bits", [8, 4])
def test_every_linear_is_replaced_within_half_a_step_and_routers_kept(make_batches, bits):
    model, report, before = _experts_and_dense(make_batches, bits=bits)
    modules = dict(model.named_modules())
    assert report.modules == list(before) and "lm_head" in before
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    for name, w in before.items():
        q = modules[name]
        assert isinstance(q, QuantizedLinear)
        # symmetric grid: step 2·max|w| / (2^bits − 1) per group of 4 columns
        step = 2 * w.abs().view(w.shape[0], -1, 4).amax(-1) / (2**bits - 1)
        err = (q.weight.double() - w).abs().view(w.shape[0], -1, 4)
        assert (err <= step.unsqueeze(-1) * (0.5 + 2**-9) + 1e-12).all(), name
    assert report.weights == sum(w.numel() for w in before.values())
    # codes + one float16 scale per 4 weights
    assert report.bytes == sum(w.numel() * bits // 8 + w.numel() // 4 * 2 for w in before.values())
    assert all(isinstance(layer.router.weight, torch.nn.Parameter) for layer in moe_layers(model))


def test_forward_is_the_dequantized_matrix(make_batches):
    model, _, _ = _experts_and_dense(make_batches)
    q = model.blocks[0].attn.q_proj
    x = torch.randn(3, 5, q.in_features, dtype=torch.float64)
    ref = F.linear(x, q.weight.double())
    assert torch.allclose(q(x), ref, rtol=0, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8, 13, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1])
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_rows_match_the_dequantized_matrix(monkeypatch, rows, bits):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(128, 96, bias=True)
    q = QuantizedLinear.from_codes(
        torch.randint(0, 2**bits, (96, 128)), torch.rand(96, 2) * 0.01 + 1e-3, bits, 64,
        lin.bias,
    )  # fmt: skip
    x = torch.randn(rows, 128)
    ref = (x.double() @ q.weight.double().T + lin.bias.double()).float()
    with torch.no_grad():
        monkeypatch.setenv("MOELAB_INT8_ACTIVATIONS", "0")  # float32 activations
        assert torch.allclose(q(x), ref, rtol=1e-5, atol=1e-5)
        monkeypatch.setenv("MOELAB_INT8_ACTIVATIONS", "1")
        if cpu_kernel.int8_activations() and rows <= KERNEL_MAX_ROWS:
            # int8 activations (step max|x|/127 per group): off by that rounding only
            err = (q(x) - ref).abs().max() / ref.abs().max()
            assert 0 < err < 0.02


@pytest.mark.parametrize("tie", [False, True])
def test_folder_loads_bit_for_bit_and_a_tied_head_is_untied(make_batches, tmp_path, tie):
    model, report, _ = _experts_and_dense(make_batches, tie=tie)
    embed = model.embed.weight.detach().clone()
    save_model(model, tmp_path / "q")
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert section["format_version"] == 3
    assert section["dense"] == {"bits": 8, "group_size": 4, "modules": report.modules}
    back = load_model(tmp_path / "q")
    assert isinstance(back.lm_head, QuantizedLinear)
    assert torch.equal(back.embed.weight, embed)  # the embedding stays float
    ids = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_experts_only_folders_stay_format_2(make_batches, tmp_path):
    model = tiny_model()
    spec = QuantSpec(method="rtn", bits=8, group_size=4, symmetric=True)
    quantize_model(model, make_batches(2), QuantizeConfig(spec=spec, sequential=False))
    save_model(model, tmp_path / "q")
    section = json.loads((tmp_path / "q" / "config.json").read_text())["quantization"]
    assert section["format_version"] == 2 and "dense" not in section


@pytest.mark.parametrize(
    ("dense", "needle"),
    [
        ({"bits": 8, "group_size": 4}, "malformed 'dense'"),
        ({"bits": 5, "group_size": 4, "modules": ["lm_head"]}, "invalid dense quantization"),
        ({"bits": 8, "group_size": 4, "modules": ["blocks.0.norm1"]}, "is not a linear layer"),
    ],
)
def test_a_bad_dense_entry_is_refused_on_load(make_batches, tmp_path, dense, needle):
    model, _, _ = _experts_and_dense(make_batches)
    save_model(model, tmp_path / "q")
    cfg_path = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization"]["dense"] = dense
    data = json.dumps(cfg).encode()
    cfg_path.write_bytes(data)
    manifest = tmp_path / "q" / "manifest.json"  # the checksums would refuse the edit first
    m = json.loads(manifest.read_text())
    m["files"]["config.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=needle):
        load_model(tmp_path / "q")


def test_bad_group_is_refused_before_anything_changes():
    model = tiny_model()
    with pytest.raises(ValueError, match="group_size: 3 does not divide"):
        quantize_dense(model, 8, 3)
    assert isinstance(model.lm_head, torch.nn.Linear)
    with pytest.raises(ValueError, match="bits"):
        quantize_dense(model, 5, 4)


def test_hf_export_refuses_quantized_weights(make_batches):
    model, _, _ = _experts_and_dense(make_batches)
    with pytest.raises(UnsupportedConfigError, match="no Hugging Face form"):
        hf_state(model)


def test_cli_dense_bits_and_bad_group(cli_model, tmp_path):
    folder, text = cli_model
    out = tmp_path / "q"
    base = ["quantize", str(folder), "--method", "rtn", "--bits", "8", "--symmetric",
            "--calib-data", str(text), "--calib-tokens", "256", "--seq-len", "32"]  # fmt: skip
    res = runner.invoke(app, [*base, "--out", str(out), "--group-size", "16", "--dense-bits", "8"])
    assert res.exit_code == 0, res.output
    dense = json.loads((out / "quantize.json").read_text())["dense"]
    assert dense["modules"][-1] == "lm_head" and dense["bits_per_param"] == 8 + 16 / 16
    ev = runner.invoke(app, ["eval", str(out), "--data", str(text), "--tokens", "256", "--json"])
    assert ev.exit_code == 0, ev.output
    bad = tmp_path / "bad"
    msg = cli_error(runner.invoke(app, [*base, "--out", str(bad), "--group-size", "16",
                                        "--dense-bits", "5"]))  # fmt: skip
    assert "bits" in msg and not bad.exists()
