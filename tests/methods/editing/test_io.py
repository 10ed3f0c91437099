"""Saving and loading an edited state; a partial stream is never saved as complete."""

import json

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.editing import (
    EditConfig,
    Editor,
    EditRequest,
    EditStateError,
    load_edits,
    save_edits,
)
from moelab.models import ModelConfig, MoETransformer
from moelab.models.linear import Linear

LAYER = "blocks.1.ffn.w_down"


def _fresh(model):
    copy = MoETransformer(model.cfg).eval()
    copy.load_state_dict(model.state_dict())
    return copy


@pytest.mark.parametrize("method", ["time", "ft-l"])
def test_a_saved_state_reloads_onto_the_base_with_identical_outputs(tiny, tmp_path, method):
    model, tok = tiny
    base = _fresh(model)
    editor = Editor(model, EditConfig(layer=LAYER, method=method, steps=3, negatives=0))
    editor.apply_stream([EditRequest("ab", "c"), EditRequest("de", "f")], tok)
    save_edits(editor, tmp_path / "e", "tiny")
    meta = json.loads((tmp_path / "e" / "edit.json").read_text())
    assert meta["complete"] and meta["applied"] == 2 and meta["base"] == "tiny"
    loaded = load_edits(tmp_path / "e", base)
    ids = torch.tensor([tok.encode("ab de")])
    assert torch.equal(base(ids).logits, model(ids).logits)
    assert loaded.num_edits == 2 and [r.target for r in loaded.requests] == ["c", "f"]


def test_a_partial_stream_is_saved_as_incomplete_and_refused_on_load(tiny, tmp_path):
    model, tok = tiny
    base = _fresh(model)
    editor = Editor(model, EditConfig(layer=LAYER, steps=1, negatives=0))
    calls = []

    def stop(i, seconds):
        calls.append(i)
        if i == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        editor.apply_stream([EditRequest("ab", "c"), EditRequest("de", "f")], tok, stop)
    save_edits(editor, tmp_path / "e", "tiny")
    assert json.loads((tmp_path / "e" / "edit.json").read_text())["complete"] is False
    with pytest.raises(EditStateError, match="partially applied stream \\(1 of 2 edits\\)"):
        load_edits(tmp_path / "e", base)
    assert load_edits(tmp_path / "e", base, allow_partial=True).num_edits == 1


def test_a_corrupt_or_mismatched_state_is_refused(tiny, tmp_path):
    model, tok = tiny
    base = _fresh(model)
    editor = Editor(model, EditConfig(layer=LAYER, steps=1, negatives=0))
    editor.apply_stream([EditRequest("ab", "c")], tok)
    save_edits(editor, tmp_path / "e", "tiny")
    other = MoETransformer(
        ModelConfig.tiny(n_layers=2, moe_layers=(0,), vocab_size=256, d_model=48)
    )
    with pytest.raises(EditStateError, match="do not fit"):
        load_edits(tmp_path / "e", other)
    assert type(other.blocks[1].ffn.w_down) is Linear  # left as it was
    (tmp_path / "e" / "edits.safetensors").write_bytes(b"junk")
    with pytest.raises(EditStateError, match="checksum"):
        load_edits(tmp_path / "e", base)
    with pytest.raises(EditStateError, match=r"no edit\.json"):
        load_edits(tmp_path, base)
    with pytest.raises(InvalidValueError):
        EditConfig(alpha=0.7, beta=0.6)
