"""The expert store: bit-exact model round trip, corrupt/truncated/foreign stores refused."""

import json
import shutil

import numpy as np
import pytest
import torch

from moelab.compress.lossless import (
    StoreError,
    compress_model,
    decompress_model,
    model_store,
    open_store,
)
from moelab.compress.lossless.store import INDEX_FILE, PACK_FILE, write_index
from moelab.compress.prune import apply_pruning
from moelab.models import ModelConfig, MoETransformer
from moelab.serve.offload.trace import record_trace


def tiny(seed=0, dtype=torch.bfloat16, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig.tiny(vocab_size=40, max_seq_len=32, **kw)
    return MoETransformer(cfg).eval().to(dtype)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("s") / "store"
    model = tiny()
    trace = np.ones((2, model.cfg.num_moe_layers, model.cfg.moe.router.num_experts), dtype=int)
    report = compress_model(model, folder, codec="zstd", trace=trace)
    return folder, model, report


def test_store_round_trips_the_model_bit_exactly(store):
    folder, model, report = store
    back = decompress_model(folder)
    ref, got = model.state_dict(), back.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert ref[k].dtype == got[k].dtype and torch.equal(ref[k], got[k]), k
    x = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x).logits, back(x).logits)
    k = report.kinds["w_gate_up"]
    assert k.elements == sum(b.ffn.experts.w_gate_up.numel() for b in model.blocks)
    assert k.sign_mantissa == k.elements  # one raw byte per bf16 element
    assert 0 < k.exponent < k.elements  # coded exponent below one byte per element
    s = open_store(folder)
    assert s.trace.shape == (2, model.cfg.num_moe_layers, 4)
    assert json.loads((folder / INDEX_FILE).read_text())["format_version"] == 4


def test_fp32_store_and_unsupported_dtype(tmp_path):
    model = tiny(dtype=torch.float32)
    compress_model(model, tmp_path / "f32", codec="ans")
    back = decompress_model(tmp_path / "f32")
    assert back.blocks[0].ffn.experts.w_down.dtype == torch.float32
    assert torch.equal(back.blocks[1].ffn.experts.w_down, model.blocks[1].ffn.experts.w_down)
    with pytest.raises(ValueError, match="bfloat16 and float32"):
        compress_model(tiny(dtype=torch.float16), tmp_path / "f16")
    assert not (tmp_path / "f16").exists()
    with pytest.raises(ValueError, match="codec"):
        compress_model(model, tmp_path / "bad", codec="lz5")
    assert not (tmp_path / "bad").exists()


def copy_store(store, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(store[0], dst)
    return dst


def corrupt_spec(folder):
    index = json.loads((folder / INDEX_FILE).read_text())
    entry = index["experts"][5]  # layer 1, expert 1 (tiny: 4 experts per layer)
    return entry["layer"], entry["expert"], entry["tensors"]["w_down"]


def test_tampered_pack_names_expert_and_file(store, tmp_path):
    folder = copy_store(store, tmp_path)
    layer, expert, spec = corrupt_spec(folder)
    with open(folder / PACK_FILE, "r+b") as f:
        f.seek(spec["sm"]["offset"] + 3)
        b = f.read(1)
        f.seek(spec["sm"]["offset"] + 3)
        f.write(bytes([b[0] ^ 0x10]))
    s = open_store(folder)  # the size is right, so opening works; the read fails
    with pytest.raises(
        StoreError, match=rf"experts.pack: layer {layer} expert {expert} tensor 'w_down'.*checksum"
    ):
        s.pack.load_tensor(layer, expert, "w_down")
    with pytest.raises(
        StoreError,
        match=rf"layer {layer} expert {expert} tensor 'w_down': sign-mantissa bytes: checksum "
        r"mismatch \(corrupt; 1 of \d+ segments bad\)",
    ):
        s.pack.verify()


def test_truncated_and_foreign_stores(store, tmp_path):
    folder = copy_store(store, tmp_path)
    with open(folder / PACK_FILE, "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        StoreError,
        match=r"experts.pack: truncated or altered .*; first segment cut: .*layer 0 expert 0",
    ):
        open_store(folder)
    # a same-size pack from another store: no segment matches the index
    shutil.copy(store[0] / PACK_FILE, folder / PACK_FILE)
    with open(folder / PACK_FILE, "r+b") as f:
        data = bytearray(f.read())
        f.seek(0)
        f.write(bytes(255 - b for b in data))
    with pytest.raises(StoreError, match=r"no segment matches store\.json"):
        open_store(folder).pack.verify()
    # an edited index (a key deleted, experts swapped) fails its own checksum at open
    shutil.copy(store[0] / PACK_FILE, folder / PACK_FILE)
    index = json.loads((folder / INDEX_FILE).read_text())
    for edit in ("pack_bytes", "swap"):
        bad = json.loads(json.dumps(index))
        if edit == "swap":
            e = bad["experts"]
            e[0]["expert"], e[1]["expert"] = e[1]["expert"], e[0]["expert"]
        else:
            del bad[edit]
        (folder / INDEX_FILE).write_text(json.dumps(bad))
        with pytest.raises(StoreError, match=r"store\.json: checksum mismatch"):
            open_store(folder)
    shutil.copy(store[0] / INDEX_FILE, folder / INDEX_FILE)
    # the routing profile the index lists is checked too
    (folder / "profile.json").write_text('{"counts": []}')
    with pytest.raises(StoreError, match=r"profile\.json: missing or altered"):
        open_store(folder)
    shutil.copy(store[0] / "profile.json", folder / "profile.json")
    open_store(folder)
    # a store whose pack and index come from another model
    other = tmp_path / "other"
    compress_model(tiny(seed=1, n_layers=3), other, codec="zstd")
    shutil.copy(other / PACK_FILE, folder / PACK_FILE)
    shutil.copy(other / INDEX_FILE, folder / INDEX_FILE)
    with pytest.raises(StoreError, match="belongs to another model"):
        open_store(folder)
    with pytest.raises(StoreError, match=r"store\.json: missing"):
        open_store(tmp_path)


def test_existing_output_is_kept(store, tmp_path):
    out = tmp_path / "keep"
    out.mkdir()
    (out / "x").write_text("mine")
    with pytest.raises(FileExistsError):
        compress_model(store[1], out)
    assert (out / "x").read_text() == "mine"


def test_contiguous_segments_come_in_one_request_and_a_bad_one_is_named(store, tmp_path):
    folder = copy_store(store, tmp_path)
    layer, expert, spec = corrupt_spec(folder)
    pack = open_store(folder).pack
    refs = spec["chunks"]
    what = [f"exponent chunk {i}" for i in range(len(refs))]
    before = pack.bytes_read
    calls = []
    real = pack.read
    pack.read = lambda o, n: calls.append((o, n)) or real(o, n)
    blobs = pack.read_segments(layer, expert, "w_down", refs, what)
    assert calls == [(refs[0]["offset"], sum(r["size"] for r in refs))]
    assert [bytes(b) for b in blobs] == [
        bytes(pack.read_segment(layer, expert, "w_down", r, w))
        for r, w in zip(refs, what, strict=True)
    ]
    assert pack.bytes_read - before == 2 * sum(r["size"] for r in refs)
    assert pack.read_segments(layer, expert, "w_down", [], []) == []
    with pytest.raises(StoreError, match="not contiguous"):
        pack.read_segments(layer, expert, "w_down", [refs[0], refs[2]], what[:2])
    with open(folder / PACK_FILE, "r+b") as f:  # flip a byte of chunk 1
        f.seek(refs[1]["offset"])
        b = f.read(1)
        f.seek(refs[1]["offset"])
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(
        StoreError,
        match=rf"layer {layer} expert {expert} tensor 'w_down': exponent chunk 1: checksum",
    ):
        pack.read_segments(layer, expert, "w_down", refs, what)


@pytest.mark.parametrize("keeps", [[[0, 1, 3], [1, 2]], [[0, 2], [0, 1, 3]]])
def test_layers_with_different_expert_counts_round_trip(keeps, tmp_path):
    """A model pruned to 3 then 2 experts (and 2 then 3): the index carries each layer's
    count, every expert is written and read back bit for bit, and the routing profile is
    ``[P, L, max E_l]`` with zeros past the smaller layer's experts."""
    model = apply_pruning(tiny(), keeps)
    counts = [len(k) for k in keeps]
    trace = record_trace(model, [torch.randint(0, 40, (12,)) for _ in range(2)])
    assert trace.shape == (2, 2, 3) and trace[:, counts.index(2), 2].sum() == 0
    assert (trace.sum(-1) == 12 * model.cfg.moe.router.top_k).all()
    compress_model(model, tmp_path / "s", trace=trace)
    s = open_store(tmp_path / "s")
    assert s.experts_per_layer == counts and s.pack.num_experts == 3
    assert np.array_equal(s.trace, trace)
    back = decompress_model(tmp_path / "s")
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    bad = trace.copy()
    bad[0, counts.index(2), 2] = 1  # tokens for an expert the layer does not have
    with pytest.raises(ValueError, match=r"trace: layer \d has 2 experts but counts tokens"):
        compress_model(model, tmp_path / "t", trace=bad)


def test_a_store_missing_an_expert_is_never_reported_written(tmp_path, monkeypatch):
    """The writer reads the store back before it moves it into place: an index that lost an
    expert fails the compress and leaves no folder; such an index also fails at open."""
    model = tiny()

    def lossy(folder, index):
        write_index(folder, {**index, "experts": index["experts"][:-1]})

    monkeypatch.setattr(model_store, "write_index", lossy)
    with pytest.raises(RuntimeError, match=r"no entry for layer 1 expert 3"):
        compress_model(model, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    monkeypatch.undo()
    compress_model(model, tmp_path / "s")
    index = json.loads((tmp_path / "s" / INDEX_FILE).read_text())
    del index["index_sha256"], index["format_version"]
    write_index(tmp_path / "s", {**index, "experts": index["experts"][1:]})
    with pytest.raises(
        StoreError, match=r"incomplete or inconsistent index \(no entry for layer 0 expert 0\)"
    ):
        open_store(tmp_path / "s")


def test_tokenizer_and_run_files_are_recorded(tmp_path):
    from moelab.compress.lossless.store import _index_digest

    def extras(tmp):
        (tmp / "tokenizer.json").write_text('{"model": "bpe-a"}')
        (tmp / "tokenizer_meta.json").write_text('{"kind": "bpe"}')

    folder = tmp_path / "s"
    compress_model(tiny(), folder, codec="zstd", save_extras=extras)
    index = json.loads((folder / INDEX_FILE).read_text())
    assert set(index["files"]) == {"tokenizer.json", "tokenizer_meta.json"}
    open_store(folder)
    good = (folder / "tokenizer.json").read_text()
    # a tokenizer swapped in from another run fails at open, before any score is computed
    (folder / "tokenizer.json").write_text('{"model": "bpe-b"}')
    with pytest.raises(StoreError, match=r"tokenizer\.json: missing or altered"):
        open_store(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(StoreError, match=r"tokenizer\.json: missing or altered"):
        open_store(folder)
    (folder / "tokenizer.json").write_text(good)
    # a run.json added after the store was written was not checked when it was written
    (folder / "run.json").write_text("{}")
    with pytest.raises(StoreError, match=r"run\.json: not written with the store"):
        open_store(folder)
    # a format-3 store (no "files") still opens, unchecked as it always was
    body = {k: v for k, v in index.items() if k not in ("index_sha256", "files")}
    body["format_version"] = 3
    (folder / INDEX_FILE).write_text(json.dumps({**body, "index_sha256": _index_digest(body)}))
    open_store(folder)


@pytest.mark.parametrize("edit", ["top_k", "codec", "entry"])
def test_an_index_missing_a_field_is_named_even_with_its_checksum_recomputed(store, tmp_path, edit):
    from moelab.compress.lossless.store import _index_digest

    folder = copy_store(store, tmp_path)
    body = json.loads((folder / INDEX_FILE).read_text())
    del body["index_sha256"]
    if edit == "entry":
        del body["experts"][3]["tensors"]
    else:
        del body[edit]
    (folder / INDEX_FILE).write_text(json.dumps({**body, "index_sha256": _index_digest(body)}))
    with pytest.raises(StoreError, match=r"store\.json: (no '\w+' entry|an 'experts' entry lacks)"):
        open_store(folder)
