"""Chains: serialisation round trips, parsing, the shipped set, the procedural fallback."""

import dataclasses

import pytest

from moelab.methods.agents.chain import (
    MARKERS,
    ChainStep,
    action_type,
    dumps_chains,
    format_target,
    loads_chains,
    parse_function,
    parse_target,
    read_chains,
    write_chains,
)
from moelab.methods.agents.oracle import TASKS
from moelab.methods.agents.toy import TOY_TASKS, toy_chains, toy_page

STEP = ChainStep(
    task="login-user",
    seed=3,
    step=0,
    utterance='Enter the username "vina" and the password "US".',
    dom='[7] input_text id=username\n[11] button "Login" id=subbtn',
    summary="username empty; password empty; button Login",
    subtask="type the username vina",
    decision="TYPE input username",
    function='type(ref=7,"vina")',
)


def test_target_text_round_trips_to_the_four_stages():
    text = STEP.target
    assert text.startswith("<ss> username empty;") and ' <af> type(ref=7,"vina")' in text
    assert parse_target(text) == dict(
        summary=STEP.summary, subtask=STEP.subtask, decision=STEP.decision, function=STEP.function
    )
    assert STEP.prompt == STEP.utterance + "\n" + STEP.dom + "\n"


def test_parse_target_keeps_first_stage_and_skips_missing():
    assert parse_target("junk <sp> a <ad> CLICK b <sp> again") == {
        "subtask": "a",
        "decision": "CLICK b",
    }


def test_format_target_refuses_a_marker_inside_a_stage_or_a_wrong_count():
    with pytest.raises(ValueError, match="marker"):
        format_target(["a", "b <af> c", "d", "e"])
    with pytest.raises(ValueError, match="need 4"):
        format_target(["a", "b"])


def test_parse_function_and_action_type():
    assert parse_function("click(ref=11)") == ("click", 11, None)
    assert parse_function('type(ref=-2,"a b")') == ("type", -2, "a b")
    assert parse_function("click(ref=x)") is None
    assert action_type("TYPE input username") == "TYPE" and action_type("GO home") == ""


def test_jsonl_gz_round_trip_is_exact_and_deterministic(tmp_path):
    steps = [STEP, dataclasses.replace(STEP, step=1, function="click(ref=11)")]
    data = dumps_chains(steps)
    assert data == dumps_chains(steps)  # no time stamp in the gzip header
    assert loads_chains(data) == steps
    write_chains(tmp_path / "c.jsonl.gz", steps)
    assert read_chains(tmp_path / "c.jsonl.gz") == steps


def test_shipped_set_covers_eight_tasks_with_parsable_chains():
    steps = read_chains()
    assert {s.task for s in steps} == set(TASKS)
    assert len(steps) > 4000
    for s in steps[::97]:
        assert parse_target(s.target) == dict(
            zip(("summary", "subtask", "decision", "function"), s.stages, strict=True)
        )
        assert parse_function(s.function) is not None
        assert not any(m in s.prompt for m in MARKERS)


def test_toy_generator_is_deterministic_per_seed_and_solves_its_pages():
    a, b = toy_chains(range(6)), toy_chains(range(6))
    assert a == b
    assert toy_chains([7]) != toy_chains([8])
    assert {s.task for s in a} == set(TOY_TASKS)
    _utterance, fields, _els = toy_page("login-user", 5)
    login = [s for s in toy_chains([5], ("login-user",))]
    assert [parse_function(s.function)[:2] for s in login] == [
        ("type", 7),
        ("type", 10),
        ("click", 11),
    ]
    assert login[0].function == f'type(ref=7,"{dict(fields)["username"]}")'
    assert login[1].summary == "username filled; password empty; button Login"
