"""A store's ``store.json`` names its pack; a forged name (absolute, ``..``, a link out of the
folder) is refused before anything is opened, even with the index checksum recomputed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moelab.compress.lossless import StoreError, compress_model, open_store
from moelab.compress.lossless.store import INDEX_FILE, PACK_FILE, write_index
from moelab.models import ModelConfig, MoETransformer


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("store") / "s"
    compress_model(MoETransformer(ModelConfig.tiny(vocab_size=64)).eval(), out)
    return out


def _forge(store, tmp_path, pack) -> object:
    copy = tmp_path / "forged"
    shutil.copytree(store, copy)
    index = json.loads((copy / INDEX_FILE).read_text())
    index.pop("index_sha256")
    index.pop("format_version")
    index["pack"] = pack(copy) if callable(pack) else pack
    write_index(copy, index)  # a consistent checksum: only the confinement can refuse it
    return copy


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "link"])
def test_a_pack_named_outside_the_store_is_refused(store, tmp_path, kind):
    outside = tmp_path / "outside.bin"
    shutil.copyfile(store / PACK_FILE, outside)  # a valid pack: no other check would fail

    def name(copy):
        if kind == "absolute":
            return str(outside)
        if kind == "dotdot":
            return "../outside.bin"
        (copy / "link.pack").symlink_to(outside)
        return "link.pack"

    forged = _forge(store, tmp_path, name)
    with pytest.raises(StoreError, match=r"store\.json: .*pack .*(absolute path|leads outside)"):
        open_store(forged)


def test_the_pack_inside_the_store_opens(store, tmp_path):
    assert open_store(_forge(store, tmp_path, PACK_FILE)).pack.path.name == PACK_FILE
