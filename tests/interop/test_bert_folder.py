"""BERT folders: save_bert → load_bert round trip, transformers reading our export, the
``bert.`` prefix, and one-line errors naming the file or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelab.data.errors import TokenizerError
from moelab.errors import InvalidValueError
from moelab.interop.bert import (
    bert_max_length,
    hf_to_moelab_names,
    load_bert,
    load_bert_tokenizer,
    save_bert,
)
from moelab.interop.errors import (
    InteropError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
)
from moelab.models import BertConfig, BertEncoder

CFG = BertConfig(
    vocab_size=40,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=24,
    max_position_embeddings=12,
)


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = BertEncoder(CFG).eval()
    return model, save_bert(model, tmp_path / "bert")


def batch():
    ids = torch.tensor([[2, 7, 9, 11, 3], [2, 5, 3, 0, 0]])
    return ids, ids != 0


def one_line_error(exc_type, fn, *needles):
    with pytest.raises(exc_type) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_round_trip_is_exact(saved):
    model, folder = saved
    loaded = load_bert(folder)
    assert loaded.cfg == CFG and not loaded.training
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b) and b.dtype == torch.float32
    ids, mask = batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask), model(ids, mask))
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == "bert" and hf["layer_norm_eps"] == 1e-12


def test_transformers_reads_our_export(saved):
    transformers = pytest.importorskip("transformers")
    model, folder = saved
    hf = transformers.BertModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        ours = model(ids, mask)
    assert (ours - ref)[mask].abs().max().item() <= 1e-5


def test_prefixed_names_buffers_and_pooler_are_accepted(saved):
    model, folder = saved
    tensors = load_file(str(folder / "model.safetensors"))
    tensors = {f"bert.{k}": v.half() for k, v in tensors.items()}
    tensors["bert.embeddings.position_ids"] = torch.arange(12)[None]
    tensors["bert.pooler.dense.weight"] = torch.zeros(16, 16)
    tensors["bert.pooler.dense.bias"] = torch.zeros(16)
    save_file(tensors, str(folder / "model.safetensors"))
    loaded = load_bert(folder)
    assert loaded.blocks[1].ffn.down.weight.dtype == torch.float32
    assert torch.equal(
        loaded.blocks[1].ffn.down.weight, model.blocks[1].ffn.down.weight.half().float()
    )


def test_truncated_or_missing_safetensors_names_the_file(saved):
    _, folder = saved
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    one_line_error(InteropError, lambda: load_bert(folder), str(path), "cannot read safetensors")
    path.write_bytes(b"")
    one_line_error(InteropError, lambda: load_bert(folder), str(path))
    path.unlink()
    one_line_error(InteropError, lambda: load_bert(folder), str(folder), "no model.safetensors")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda p: p.write_text('{"hidden_size": 16'), "not valid JSON"),
        (lambda p: p.unlink(), "missing"),
        (lambda p: p.write_text("[1, 2]"), "config: expected a JSON object"),
        (
            lambda p: p.write_text(json.dumps(CFG.to_hf() | {"hidden_act": "relu"})),
            "hidden_act: must be one of 'gelu'",
        ),
        (
            lambda p: p.write_text(json.dumps(CFG.to_hf() | {"num_attention_heads": 3})),
            "hidden_size: 16 is not a multiple of num_attention_heads (3)",
        ),
    ],
)
def test_bad_config_names_the_file(saved, edit, needle):
    _, folder = saved
    edit(folder / "config.json")
    one_line_error(InteropError, lambda: load_bert(folder), str(folder / "config.json"), needle)


def test_missing_unexpected_and_misshapen_tensors_are_named(saved):
    _, folder = saved
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    save_file(tensors | {"classifier.weight": torch.zeros(2, 16)}, str(path))
    one_line_error(UnexpectedTensorError, lambda: load_bert(folder), str(path), "classifier.weight")
    del tensors["encoder.layer.1.output.LayerNorm.bias"]
    save_file(tensors, str(path))
    one_line_error(
        MissingTensorError, lambda: load_bert(folder), "encoder.layer.1.output.LayerNorm.bias"
    )
    tensors["encoder.layer.1.output.LayerNorm.bias"] = torch.zeros(15)
    save_file(tensors, str(path))
    one_line_error(
        TensorShapeError, lambda: load_bert(folder), "blocks.1.ffn_norm.bias has shape (15,)"
    )


def test_name_map_covers_the_state_dict_once():
    names = hf_to_moelab_names(CFG)
    assert sorted(names.values()) == sorted(BertEncoder(CFG).state_dict())
    assert names["encoder.layer.1.attention.self.key.bias"] == "blocks.1.attn.k_proj.bias"
    assert names["encoder.layer.0.intermediate.dense.weight"] == "blocks.0.ffn.up.weight"


def test_tokenizer_length_settings(saved, tmp_path):
    _, folder = saved
    assert bert_max_length(folder, CFG) == 12
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 8}')
    assert bert_max_length(folder, CFG) == 8
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 13}')
    one_line_error(
        InteropError,
        lambda: bert_max_length(folder, CFG),
        "max_seq_length must be an int in [2, 12]",
    )
    one_line_error(
        InvalidValueError,
        lambda: load_bert_tokenizer(folder, CFG, max_length=13),
        "max_length: 13 exceeds max_position_embeddings (12)",
    )
    one_line_error(
        TokenizerError,
        lambda: load_bert_tokenizer(folder, CFG, max_length=8),
        str(folder / "tokenizer.json"),
    )
