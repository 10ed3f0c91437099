import json
import math
import os

import pytest
import torch

from moelab.analysis import (
    adjacent_consistency,
    analyze,
    confidence_stats,
    domain_stats,
    effective_rank,
    load_stats,
    transition,
    write_json,
)


def test_analyze_is_json_serialisable_and_matches_the_metrics(run3):
    records, domains, hidden, outputs = run3
    out = analyze(records, domains, ["code", "prose"], hidden, outputs)
    text = json.dumps(out, allow_nan=False)  # raises on tensors, NaN or infinity
    back = json.loads(text)
    assert back["num_layers"] == 3
    assert back["num_experts"] == [4, 4, 4]
    assert back["domain_names"] == ["code", "prose"]
    assert len(back["layers"]) == 3
    assert len(back["transitions"]) == 2
    lay = back["layers"][1]
    assert lay["load"]["counts"] == load_stats(records[1]).counts.tolist()
    assert sum(lay["load"]["counts"]) == 2 * (32 - 3)  # top-2 over 29 valid tokens
    assert lay["confidence"]["entropy"] == pytest.approx(confidence_stats(records[1]).entropy)
    assert lay["adjacent_consistency"]["fraction"] == adjacent_consistency(records[1]).fraction
    assert lay["domains"]["nmi"] == pytest.approx(domain_stats(records[1], domains).nmi)
    assert lay["effective_rank"] == pytest.approx(effective_rank(hidden[1]))
    assert len(lay["coactivation"]["counts"]) == 4
    assert back["transitions"][0]["counts"] == transition(records[0], records[1]).counts.tolist()
    head = back["headline"]
    assert [h["layer"] for h in head] == [0, 1, 2]
    assert head[2]["pathway_nmi_next"] is None
    assert head[0]["pathway_nmi_next"] == pytest.approx(back["transitions"][0]["nmi"])
    # the synthetic router prefers experts by domain, so the domain NMI is clearly positive
    assert all(h["domain_nmi"] > 0.2 for h in head)
    assert all(0.0 <= h["normalized_entropy"] <= 1.0 for h in head)
    assert all(-1.0 <= h["redundancy"] <= 1.0 for h in head)


def test_analyze_without_optional_inputs(run3):
    records = run3[0]
    out = analyze(records[:1])
    assert out["transitions"] == []
    assert "domains" not in out["layers"][0]
    assert out["headline"][0]["domain_nmi"] is None
    assert out["domain_names"] is None
    json.dumps(out, allow_nan=False)
    named = analyze(records, run3[1])
    assert named["domain_names"] == ["domain 0", "domain 1"]


def test_analyze_errors(run3):
    records, _, hidden, _ = run3
    with pytest.raises(ValueError, match="at least one layer"):
        analyze([])
    with pytest.raises(ValueError, match="hidden_by_layer"):
        analyze(records, hidden_by_layer=hidden[:2])
    with pytest.raises(ValueError, match="without domains"):
        analyze(records, domain_names=["a", "b"])


def test_write_json_is_atomic_and_round_trips(tmp_path):
    path = tmp_path / "sub" / "analysis.json"
    obj = {"a": [1, 2], "t": torch.tensor([[1.5, 2.0]]), "x": 0.25}
    assert write_json(obj, path) == path
    assert json.loads(path.read_text()) == {"a": [1, 2], "t": [[1.5, 2.0]], "x": 0.25}
    with pytest.raises(ValueError):
        write_json({"bad": math.nan}, path)
    # the failed write left the previous file intact and no temp file behind
    assert json.loads(path.read_text())["x"] == 0.25
    assert os.listdir(path.parent) == ["analysis.json"]
