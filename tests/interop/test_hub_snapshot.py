"""A Hugging Face hub cache snapshot (every file a symlink into the repository's ``blobs/``)
converts; a link leading out of the repository is still refused."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from moelab.interop import InteropError
from moelab.interop.hf import convert, export_hf
from moelab.models import ModelConfig, MoETransformer, load_model


def _hub_snapshot(hf_folder, cache):
    """Lay ``hf_folder`` out as the hub does: blobs named by hash, snapshot links to them."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in sorted(hf_folder.iterdir()):
        if f.name.startswith("."):
            continue
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    return snap


@pytest.fixture
def hf_sharded(tmp_path):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.tiny(vocab_size=64, max_seq_len=32)).eval()
    folder = export_hf(model, tmp_path / "hf", "mixtral")
    # one shard named by an index, as save_pretrained writes large checkpoints
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    from safetensors.torch import load_file

    names = load_file(str(folder / "model-00001-of-00001.safetensors"))
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    return model, folder


def test_a_hub_snapshot_converts(hf_sharded, tmp_path):
    model, folder = hf_sharded
    snap = _hub_snapshot(folder, tmp_path / "hub")
    assert all(p.is_symlink() for p in snap.iterdir())
    report = convert(snap, tmp_path / "out", "moelab")
    assert report.copied_files == ["tokenizer.json"]
    back = load_model(tmp_path / "out")
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x).logits)


def test_a_snapshot_link_leaving_its_repository_is_refused(hf_sharded, tmp_path):
    _, folder = hf_sharded
    snap = _hub_snapshot(folder, tmp_path / "hub")
    outside = tmp_path / "secret.json"
    outside.write_text('{"leaked": true}')
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").symlink_to(outside)
    with pytest.raises(InteropError, match="leads outside the folder"):
        convert(snap, tmp_path / "out", "moelab")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_ordinary_folder_still_confines_links_to_itself(hf_sharded, tmp_path):
    _, folder = hf_sharded
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.json").symlink_to(elsewhere)
    with pytest.raises(InteropError, match="leads outside the folder"):
        convert(folder, tmp_path / "out", "moelab")
