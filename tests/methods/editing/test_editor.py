"""Editing a tiny moelab LM: the edit takes, restore is bit-identical, bad input is refused."""

import pytest
import torch

from moelab.errors import InvalidValueError
from moelab.methods.editing import EditConfig, Editor, EditRequest, tokenize_edit
from moelab.methods.editing.layer import EditedLinear

LAYER = "blocks.1.ffn.w_down"
SETTINGS = {
    "time": dict(steps=60, lr=5e-2),
    "lora-key": dict(steps=60, lr=5e-2),
    "grace": dict(steps=60, grace_lr=0.5),
    "ft-l": dict(steps=60, ft_lr=1e-2),
}


def _next_token(model, tok, prompt: str) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([tok.encode(prompt)])).logits[0, -1].argmax())


@pytest.mark.parametrize("method", list(SETTINGS))
def test_after_an_edit_its_target_is_the_argmax_and_restore_is_bit_identical(tiny, method):
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logits_before = model(torch.tensor([tok.encode("hello")])).logits
    target = "Z"
    assert _next_token(model, tok, "capital of X is ") != tok.encode(target)[0]
    editor = Editor(model, EditConfig(layer=LAYER, method=method, negatives=0, **SETTINGS[method]))
    editor.apply_stream([EditRequest("capital of X is ", target)], tok)
    assert editor.num_edits == 1
    assert _next_token(model, tok, "capital of X is ") == tok.encode(target)[0]
    if method != "ft-l":
        assert isinstance(model.blocks[1].ffn.w_down, EditedLinear)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
    editor.restore()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model(torch.tensor([tok.encode("hello")])).logits, logits_before)
    assert all(p.requires_grad for p in model.parameters())


def test_a_missing_layer_and_a_non_linear_one_are_refused(tiny):
    model, _ = tiny
    with pytest.raises(InvalidValueError, match="no module 'blocks\\.9"):
        Editor(model, EditConfig(layer="blocks.9.ffn.w_down"))
    with pytest.raises(InvalidValueError, match="not an nn\\.Linear"):
        Editor(model, EditConfig(layer="blocks.1.ffn"))


def test_over_capacity_and_bad_targets_are_refused_before_any_edit(tiny):
    model, tok = tiny
    editor = Editor(model, EditConfig(layer=LAYER, capacity=2, steps=1))
    three = [EditRequest(f"p{i}", " q") for i in range(3)]
    with pytest.raises(InvalidValueError, match="3 edits exceed the capacity left \\(2 of 2\\)"):
        editor.apply_stream(three, tok)
    with pytest.raises(InvalidValueError, match="edit 1: empty target"):
        editor.apply_stream([EditRequest("a", " b"), EditRequest("a", "  ")], tok)
    assert editor.num_edits == 0 and editor.bank.num_edits == 0


def test_a_target_that_tokenises_to_nothing_is_refused():
    class Drops:  # a tokenizer that drops characters it does not know
        def encode(self, text):
            return [ord(c) for c in text if c.isascii()]

    with pytest.raises(InvalidValueError, match="target 'é' tokenises to nothing"):
        tokenize_edit(EditRequest("the answer is", "é"), Drops(), 64)
    edit = tokenize_edit(EditRequest("ab", "cd"), Drops(), 64)
    assert edit.input_ids.tolist() == [97, 98, 99] and edit.positions.tolist() == [1, 2]
    assert edit.targets.tolist() == [99, 100]
