"""Calibration: windows, routing with observers, streaming float64 statistics."""

from __future__ import annotations

import pytest
import torch

from moelab.compress import (
    calibration_set,
    collect_stats,
    domain_streams,
    expert_outputs,
    route,
    routed_pairs,
)
from moelab.data import ByteTokenizer, CorpusError, Document
from moelab.models.hooks import moe_layers


def _reference(model, batches):
    """Non-streaming reference: keep every layer input/output and every pair, then reduce."""
    per_layer = {}

    def keep(i, layer, x, out):
        per_layer.setdefault(i, []).append((layer, x.reshape(-1, x.shape[-1]), out))

    route(model, batches, keep)
    refs = []
    for i in sorted(per_layer):
        calls = per_layer[i]
        X = torch.cat([x for _, x, _ in calls])
        Y = torch.cat([o.hidden_states.reshape(-1, X.shape[1]) for _, _, o in calls])
        layer = calls[0][0]
        E = layer.experts.num_experts
        counts = torch.zeros(E, dtype=torch.int64)
        gate = torch.zeros(E, dtype=torch.float64)
        energy = torch.zeros(E, dtype=torch.float64)
        dirs = [[] for _ in range(E)]
        for _, x, out in calls:
            p = out.plan
            for t, e, w in zip(
                p.token_idx.tolist(), p.expert_idx.tolist(), p.weight.tolist(), strict=True
            ):
                f = layer.experts.expert_output(x[t : t + 1], e)[0]
                o = w * f
                counts[e] += 1
                gate[e] += w
                energy[e] += o.norm()
                dirs[e].append(o / o.norm())
        refs.append((X, Y, counts, gate, energy, dirs))
    return refs


def test_streaming_stats_equal_non_streaming_reference(make_model, make_batches):
    model = make_model(E=5, k=2, shared_expert_size=8)
    batches = make_batches(n=4)
    stats = collect_stats(model, batches, directions=True)
    for s, (X, Y, counts, gate, energy, dirs) in zip(
        stats, _reference(model, batches), strict=True
    ):
        assert s.n_tokens == X.shape[0] == 4 * 2 * 8
        torch.testing.assert_close(s.covariance("input"), torch.cov(X.T, correction=0))
        torch.testing.assert_close(s.covariance("output"), torch.cov(Y.T, correction=0))
        assert torch.equal(s.counts, counts)
        assert int(counts.sum()) == X.shape[0] * 2
        torch.testing.assert_close(s.gate_sum, gate)
        torch.testing.assert_close(s.energy, energy)
        for e, u in enumerate(dirs):
            if len(u) >= 2:
                U = torch.stack(u)
                ref = torch.cov(U.T, correction=0)
                torch.testing.assert_close(s.direction_covariance(e), ref)


def test_stats_do_not_depend_on_batching(make_model, make_batches):
    model = make_model()
    big = [torch.cat(make_batches(n=4))]
    small = make_batches(n=4)
    a, b = collect_stats(model, big), collect_stats(model, small)
    for sa, sb in zip(a, b, strict=True):
        torch.testing.assert_close(sa.sum_out_outer, sb.sum_out_outer)
        assert torch.equal(sa.counts, sb.counts)
        torch.testing.assert_close(sa.energy, sb.energy)


def test_route_stops_after_the_requested_layer(make_model, make_batches):
    model = make_model(layers=3)
    seen = []
    n = route(model, make_batches(n=2), lambda i, *_: seen.append(i), upto_layer=1)
    assert seen == [0, 1, 0, 1] and n == 2 * 2 * 8
    with pytest.raises(ValueError, match="upto_layer"):
        route(model, make_batches(n=1), lambda *a: None, upto_layer=3)
    stats = collect_stats(model, make_batches(n=1), layers=[0])
    assert stats[1] is None and stats[2] is None and stats[0].n_tokens == 16


def test_routed_pairs_reproduce_the_layer_output(make_model, make_batches):
    model = make_model(E=4, k=2)
    layer = moe_layers(model)[0]
    x = torch.randn(10, 16, dtype=torch.float64)
    out = layer(x)
    pairs = routed_pairs(layer, x, out.plan)
    y = expert_outputs(layer, pairs) * pairs.weight.double()[:, None]
    ref = torch.zeros(10, 16, dtype=torch.float64).index_add(0, pairs.token_idx, y)
    torch.testing.assert_close(ref, out.hidden_states)
    assert torch.all(pairs.expert_idx[1:] >= pairs.expert_idx[:-1])
    assert pairs.counts.tolist() == torch.bincount(pairs.expert_idx, minlength=4).tolist()


def _streams():
    docs = [
        Document(name="a", domain="code", text="def f(x):\n    return x\n" * 20),
        Document(name="b", domain="prose", text="To be or not to be. " * 25),
    ]
    return domain_streams(docs, ByteTokenizer())


def test_calibration_set_is_seeded_balanced_and_checked():
    streams = _streams()
    c = calibration_set(streams, tokens=100, seq_len=10, batch_size=4, seed=3)
    assert c.n_tokens == 100 and c.domain_names == ("code", "prose")
    dom = torch.cat(c.domains)
    assert (dom == 0).sum() == 5 and (dom == 1).sum() == 5
    again = calibration_set(streams, tokens=100, seq_len=10, batch_size=4, seed=3)
    other = calibration_set(streams, tokens=100, seq_len=10, batch_size=4, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(c, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(c, other, strict=True))
    # every row is a real window of its domain's stream
    for ids, d in zip(c.batches, c.domains, strict=True):
        for row, di in zip(ids, d.tolist(), strict=True):
            s = streams[c.domain_names[di]].ids
            assert any(torch.equal(s[i : i + 10], row) for i in range(len(s) - 9))
    with pytest.raises(CorpusError, match="calib_tokens: domain 'code'"):
        calibration_set(streams, tokens=2000, seq_len=10, batch_size=4)
    with pytest.raises(ValueError, match="tokens"):
        calibration_set(streams, tokens=0, seq_len=10, batch_size=4)


def test_default_calibration_is_the_held_out_half_of_the_run_validation_docs(tmp_path):
    from moelab.compress import RunData, calibration_documents, held_out_documents
    from moelab.data import load_corpus, split_documents

    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"document {i}\n" * 30)
    run = RunData(data=str(tmp_path), val_fraction=0.25, seed=5)
    calib, evaluation = held_out_documents(run)
    train, val = split_documents(load_corpus(str(tmp_path)), val_fraction=0.25, seed=5)
    names = lambda ds: {d.name for d in ds}  # noqa: E731
    assert names(calib) | names(evaluation) == names(val) and len(val) == 10
    assert not names(calib) & names(evaluation) and len(calib) == 5
    assert not names(calib) & names(train)
    assert names(calibration_documents(None, run)) == names(calib)
    assert len(calibration_documents(str(tmp_path), None)) == 40
    with pytest.raises(ValueError, match="calib_data"):
        calibration_documents(None, None)


def test_run_data_takes_the_split_seed_the_run_trained_with(tmp_path):
    # a multi-seed comparison trains seed 1 with split seed 0: its held-out documents are
    # split seed 0's, so calibration must not read seed 1's split (training text for it)
    import json

    from moelab.compress import run_data

    def folder(name: str, train: dict):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"train": train}))
        return run_data(tmp_path / name)

    base = {"data": "mix", "max_bytes_per_domain": 1000, "val_fraction": 0.1, "seed": 1}
    assert folder("split", {**base, "split_seed": 0}).seed == 0
    assert folder("null", {**base, "split_seed": None}).seed == 1
    plain = folder("plain", base)
    assert (plain.data, plain.max_bytes_per_domain, plain.val_fraction, plain.seed) == (
        "mix",
        1000,
        0.1,
        1,
    )
    assert run_data(tmp_path / "absent") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "run.json").write_text(json.dumps({"train": {"seed": 1}}))
    with pytest.raises(ValueError, match="no 'train' section naming the training data"):
        run_data(tmp_path / "bad")
