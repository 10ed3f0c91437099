"""CaRE and the baselines end to end on a tiny stream: save → load mid-stream gives the same
predictions, and the run goes on from there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.methods.continual.io import ContinualRunError, load_learner, read_run, save_learner
from moelab.methods.continual.loop import run_stream

from ._tiny import tiny_encoder, tiny_learner


@pytest.mark.parametrize("method", ["care", "aper", "finetune", "simplecil"])
def test_save_load_mid_stream_same_predictions(tmp_path, method):
    enc = tiny_encoder()
    learner = tiny_learner(method, encoder=enc)
    part = run_stream(learner, stop=2)
    R = np.full((3, 3), np.nan)
    R[:2, :2] = part.R
    save_learner(learner, 0, tmp_path / "run", R)
    config, seed, n, R_back = read_run(tmp_path / "run")
    assert (config.method, seed, n) == (method, 0, 2)
    np.testing.assert_array_equal(R_back[:2, :2], part.R)
    fresh = tiny_learner(method, encoder=enc, seed=0)
    load_learner(tmp_path / "run", fresh)
    test = list(learner.stream.tasks[0].test) + list(learner.stream.tasks[1].test)
    # the frozen features of the fresh learner come from other padded batches: equal up to
    # float rounding, and the predictions are the same
    with torch.no_grad():
        torch.testing.assert_close(fresh.logits(test), learner.logits(test), rtol=0, atol=1e-5)
    cand = range(learner.stream.seen_classes(1))
    assert torch.equal(fresh.predict(test, cand), learner.predict(test, cand))
    # both go on to the last task with the same data order and RNG state
    rest = run_stream(fresh, start=2, R=R_back)
    assert rest.R.shape == (3, 3) and not np.isnan(rest.R[2]).any()


def test_load_refuses_a_folder_of_another_shape(tmp_path):
    enc = tiny_encoder()
    learner = tiny_learner("care", encoder=enc)
    run_stream(learner, stop=2)
    save_learner(learner, 0, tmp_path / "run")
    other = tiny_learner("care", encoder=enc, expert_dim=3)
    with pytest.raises(ContinualRunError, match="does not fit its config"):
        load_learner(tmp_path / "run", other)
    with pytest.raises(ContinualRunError, match="missing"):
        read_run(tmp_path / "nothing")


def test_read_run_refuses_a_matrix_larger_than_the_stream(tmp_path):
    import json

    learner = tiny_learner("care")
    run_stream(learner, stop=1)
    save_learner(learner, 0, tmp_path / "run")
    meta_file = tmp_path / "run" / "continual.json"
    meta = json.loads(meta_file.read_text())
    meta["R"] = [[1.0] * (meta["stream_tasks"] + 1)]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ContinualRunError, match="R is larger than"):
        read_run(tmp_path / "run")
