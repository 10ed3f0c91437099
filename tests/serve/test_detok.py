"""Incremental detokenization: UTF-8 hold-back and stop strings spanning tokens."""

from __future__ import annotations

from moelab.data import ByteTokenizer
from moelab.serve.detok import Detokenizer

TOK = ByteTokenizer()


def feed(detok: Detokenizer, text: str) -> list[tuple[str, str, bool]]:
    return [detok.push(t) for t in TOK.encode(text)]


def test_stop_string_across_tokens_is_cut_and_never_emitted():
    d = Detokenizer(TOK, stop=("END",))
    out = feed(d, "abEN")
    assert "".join(o[0] for o in out) == "ab"  # "EN" is held: it may start "END"
    delta, token_text, stopped = d.push(TOK.encode("D")[0])
    assert (delta, token_text, stopped) == ("", "D", True)
    assert d.text == "ab" and d.flush() == ""


def test_held_prefix_is_released_when_it_does_not_become_a_stop():
    d = Detokenizer(TOK, stop=("END", "xy"))
    out = feed(d, "aENx")
    assert "".join(o[0] for o in out) == "aEN"  # "EN" released once "x" breaks "END"
    assert d.flush() == "x"  # the end of the sequence releases the rest
    assert d.text == "aENx"


def test_multibyte_characters_are_held_until_complete():
    d = Detokenizer(TOK, stop=("✓",))
    out = feed(d, "é✓z")
    assert [o[0] for o in out[:2]] == ["", "é"]
    assert [o[1] for o in out[:2]] == ["", "é"]
    assert out[4][2] is True and d.text == "é"  # the 3-byte stop matched on its last byte
