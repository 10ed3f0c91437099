from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelab.models import (
    FORMAT_VERSION,
    CheckpointError,
    MoETransformer,
    load_model,
    save_model,
)
from moelab.models.io import MANIFEST_FILE, WEIGHTS_FILE, sha256_file


def _trained_like(model: MoETransformer) -> MoETransformer:
    """Perturb weights and the expert bias so nothing equals its initial value."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        for b in model.buffers():
            if b.is_floating_point():
                b.add_(torch.randn_like(b))
    return model


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(tie_embeddings=True, n_kv_heads=2), dict(dense=True), dict(first_dense_layers=1)],
)
def test_round_trip_bit_identical(tmp_path, model_factory, kw):
    model = _trained_like(model_factory(**kw))
    save_model(model, tmp_path / "ckpt")
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {
        "config.json",
        "model.safetensors",
        "manifest.json",
    }
    loaded = load_model(tmp_path / "ckpt").eval()
    assert loaded.cfg == model.cfg
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ids = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    if model.cfg.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embed.weight
        assert "lm_head.weight" not in load_file(tmp_path / "ckpt" / WEIGHTS_FILE)


def test_expert_bias_buffer_round_trips(tmp_path, cfg_factory):
    import dataclasses

    cfg = cfg_factory()
    cfg = dataclasses.replace(
        cfg,
        moe=dataclasses.replace(
            cfg.moe, router=dataclasses.replace(cfg.moe.router, expert_bias=True)
        ),
    )
    model = _trained_like(MoETransformer(cfg))
    bias = model.blocks[0].ffn.router.expert_bias
    assert bias.abs().sum() > 0
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert torch.equal(loaded.blocks[0].ffn.router.expert_bias, bias)


def test_bf16_round_trip(tmp_path, model_factory):
    model = model_factory().to(torch.bfloat16)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.embed.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.blocks[1].ffn.experts.w_down, model.blocks[1].ffn.experts.w_down)


def test_config_and_manifest_contents(tmp_path, model_factory):
    save_model(model_factory(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["format_version"] == FORMAT_VERSION
    assert cfg["model"]["moe"]["router"]["num_experts"] == 4
    man = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert man["files"][WEIGHTS_FILE]["sha256"] == sha256_file(tmp_path / WEIGHTS_FILE)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------- bad checkpoints
@pytest.fixture
def saved(tmp_path, model_factory):
    save_model(model_factory(), tmp_path)
    return tmp_path


def _rewrite_weights(folder, edit):
    """Rewrite the weights with ``edit(dict)`` and refresh the manifest's checksum, so that
    only the tensor check (not the checksum) can catch the problem."""
    path = folder / WEIGHTS_FILE
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    man = json.loads((folder / MANIFEST_FILE).read_text())
    man["files"][WEIGHTS_FILE] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (folder / MANIFEST_FILE).write_text(json.dumps(man))


def test_newer_format_version(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["format_version"] = FORMAT_VERSION + 1
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*newer"):
        load_model(saved)


def test_newer_manifest_version(saved):
    man = json.loads((saved / MANIFEST_FILE).read_text())
    man["format_version"] = FORMAT_VERSION + 5
    (saved / MANIFEST_FILE).write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match=r"manifest\.json.*newer"):
        load_model(saved)


def test_missing_weight_file(saved):
    (saved / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*missing"):
        load_model(saved)


def test_missing_manifest(saved):
    (saved / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json.*missing"):
        load_model(saved)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a model folder"):
        load_model(tmp_path / "nope")


def test_corrupt_weight_file(saved):
    path = saved / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside a tensor: same size, still parseable
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*checksum"):
        load_model(saved)


def test_truncated_weight_file(saved):
    path = saved / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_model(saved)


def test_unreadable_weight_file_with_matching_checksum(saved):
    (saved / WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    _refresh = json.loads((saved / MANIFEST_FILE).read_text())
    _refresh["files"][WEIGHTS_FILE] = {"sha256": sha256_file(saved / WEIGHTS_FILE)}
    (saved / MANIFEST_FILE).write_text(json.dumps(_refresh))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*cannot read"):
        load_model(saved)


def test_missing_tensor(saved):
    _rewrite_weights(saved, lambda t: t.pop("blocks.1.ffn.experts.w_down"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*blocks\.1\.ffn\.experts\.w_down"):
        load_model(saved)


def test_extra_tensor(saved):
    _rewrite_weights(saved, lambda t: t.update({"blocks.9.attn.q_proj.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*blocks\.9\.attn\.q_proj"):
        load_model(saved)


def test_shape_mismatch(saved):
    def edit(t):
        t["blocks.0.attn.o_proj.weight"] = torch.zeros(32, 16)

    _rewrite_weights(saved, edit)
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.o_proj\.weight.*\(32, 16\)"):
        load_model(saved)


def test_invalid_config(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["model"]["n_kv_heads"] = 3
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*n_kv_heads"):
        load_model(saved)


def test_checkpoint_error_is_value_error():
    assert issubclass(CheckpointError, ValueError)
