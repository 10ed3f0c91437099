import itertools
import json
import math
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

import moelab.train.loop as loop
from moelab.core.experts import cpu_kernel
from moelab.train.budget import (
    MARGIN,
    BudgetFit,
    fit_step,
    fit_steps,
    predicted_seconds,
    progress_at,
    recorded_fits,
)
from moelab.train.checkpoint import checkpoint_dirs
from moelab.train.config import ConfigError

from .conftest import tiny_model, tiny_train

COSTS = dict(eval_every=200, eval_s=10.0, checkpoint_every=100, checkpoint_s=1.0)


def test_predicted_seconds_counts_steps_validations_and_checkpoints_by_hand():
    # 420 steps of 0.5 s; validations at 200, 400 and the final 450; checkpoints at 100..400
    got = predicted_seconds(450, step=30, elapsed_s=20.0, step_s=0.5, **COSTS)
    assert got == pytest.approx(20 + 210 + 3 * 10 + 4 * 1)
    # a total on an eval step validates once there; a final checkpoint is not counted
    got = predicted_seconds(400, step=30, elapsed_s=20.0, step_s=0.5, **COSTS)
    assert got == pytest.approx(20 + 185 + 2 * 10 + 3 * 1)


def test_fit_is_the_largest_total_within_the_budget_by_hand():
    def fit(**kw):
        args = dict(step=10, elapsed_s=5.0, budget_s=100.0, max_steps=1000,
                    step_times=[1, 1, 1, 1, 1, 9], eval_every=100, eval_s=0.0,
                    checkpoint_every=0, checkpoint_s=0.0)  # fmt: skip
        return fit_steps(**{**args, **kw})

    # 5 + (N − 10) · 1 ≤ 97 (the median ignores the one slow step)
    assert fit().steps == 102 and fit().step_s == 1.0
    # with 3 s validations: N = 99 costs 94 + 3 = 97; N = 100 costs 95 + 3; N = 101 costs 96 + 6
    assert fit(eval_s=3.0).steps == 99
    assert fit(max_steps=50).steps == 50  # a fast machine runs the steps asked for
    assert fit(elapsed_s=99.0).steps == 11  # nothing fits: one more step, then the budget stops
    assert fit() == BudgetFit(at_step=10, requested_steps=1000, steps=102, step_s=1.0,
                              eval_s=0.0, checkpoint_s=0.0)  # fmt: skip


def test_fit_equals_a_linear_scan_of_every_total():
    cases = itertools.product([0, 7, 30], [1.0, 40.0], [0.3, 0.9], [25, 200], [0.0, 4.0])
    for step, elapsed, step_s, eval_every, eval_s in cases:
        costs = dict(eval_every=eval_every, eval_s=eval_s, checkpoint_every=50, checkpoint_s=0.7)
        fit = fit_steps(step=step, elapsed_s=elapsed, budget_s=150.0, max_steps=600,
                        step_times=[step_s] * 5, **costs)  # fmt: skip
        within = [
            n
            for n in range(step + 1, 601)
            if predicted_seconds(n, step=step, elapsed_s=elapsed, step_s=step_s, **costs)
            <= (1 - MARGIN) * 150.0
        ]
        assert fit.steps == max(within, default=step + 1)


def test_fit_refuses_too_few_or_bad_step_times():
    args = dict(step=5, elapsed_s=1.0, budget_s=10.0, max_steps=20, **COSTS)
    with pytest.raises(ValueError, match=">= 5 step times"):
        fit_steps(step_times=[0.1] * 4, **args)
    with pytest.raises(ValueError, match="finite"):
        fit_steps(step_times=[0.1] * 4 + [float("nan")], **args)


def test_fit_step_is_the_end_of_the_warmup_with_enough_timed_steps():
    assert fit_step(30) == 30
    assert fit_step(2) == 15  # 10 untimed + 5 timed steps


def test_config_needs_a_budget_and_no_expansion(corpus):
    with pytest.raises(ConfigError, match="--time-budget"):
        tiny_train(corpus, fit_to_budget=True)
    with pytest.raises(ConfigError, match="expand_at"):
        tiny_train(corpus, fit_to_budget=True, time_budget_s=60.0, steps=20, expand_at=10,
                   expand_hidden=2.0)  # fmt: skip


def _fake_fit(calls, totals):
    """Replaces the timing-dependent fit with a fixed total per fit step, recording its
    arguments."""

    def fake(**kw):
        calls.append({**kw, "step_times": list(kw["step_times"])})
        step = kw["step"]
        return BudgetFit(
            step, kw["max_steps"], totals[step], 0.01, kw["eval_s"], 0.0, kw["progress"]
        )

    return fake


def _records(run_dir, split):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _expected_progress(step):
    """By hand for 2 warmup steps, --steps 60 and fits at 15 (total 50), 30 (52), 50 (52)."""
    p1 = 13 / 58
    p2 = p1 + (1 - p1) * 15 / 35
    p3 = p2 + (1 - p2) * 20 / 22
    if step < 15:
        return (step - 2) / 58
    if step < 30:
        return p1 + (1 - p1) * (step - 15) / 35
    if step < 50:
        return p2 + (1 - p2) * (step - 30) / 22
    return p3 + (1 - p3) * (step - 50) / 2


def test_refits_after_validations_keep_the_cosine_continuous_and_resume_exactly(
    corpus, tmp_path, monkeypatch
):
    calls = []
    monkeypatch.setattr(loop, "fit_steps", _fake_fit(calls, {15: 50, 30: 52, 50: 52}))
    cfg = tiny_train(corpus, steps=60, eval_every=10, time_budget_s=1e6, fit_to_budget=True)
    full, part = tmp_path / "full", tmp_path / "part"
    result = loop.train(tiny_model(), cfg, full, progress=False)
    # the first fit before step 15 (2 warmup steps, 10 untimed + 5 timed); then one after each
    # validation at least 15 steps on: 30, 50 (40 is too close to 30, 60 is past the end)
    assert [c["step"] for c in calls] == [15, 30, 50]
    assert [len(c["step_times"]) for c in calls] == [5, 15, 20]
    assert all(c["max_steps"] == 60 and c["eval_s"] > 0 for c in calls)
    for c in calls:
        assert c["progress"] == pytest.approx(_expected_progress(c["step"]))
    assert not result.interrupted and result.step == 52 and (full / "manifest.json").exists()
    info = json.loads((full / "run.json").read_text())
    assert info["train"]["steps"] == 52
    assert [(f["at_step"], f["steps"]) for f in info["budget_fits"]] == [
        (15, 50),
        (30, 52),
        (50, 52),
    ]
    r = cfg.min_lr_ratio
    for rec in _records(full, "train"):
        s = rec["step"] - 1  # the record of step s + 1 carries the rate step s ran at
        want = (
            cfg.lr * (s + 1) / 2
            if s < 2
            else cfg.lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi * _expected_progress(s))))
        )
        assert rec["lr"] == pytest.approx(want, rel=1e-9), s
    assert [r["step"] for r in _records(full, "val")] == [0, 10, 20, 30, 40, 50, 52]

    # interrupted at 33, then the checkpoints after 12 lost: the resume replays both fits
    stopped = loop.train(tiny_model(), cfg, part, progress=False, stop_after=33)
    assert stopped.interrupted and [c["step"] for c in calls[3:]] == [15, 30]
    for step, folder in checkpoint_dirs(part):
        if step > 12:
            shutil.rmtree(folder)
    loop.train(None, None, part, resume=True, progress=False)
    assert [c["step"] for c in calls[5:]] == [50]  # only the fit not yet recorded is taken
    a, b = _records(full, "train"), _records(part, "train")
    assert [r["step"] for r in b] == list(range(1, 53))
    for x, y in zip(a, b, strict=True):
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-12)
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-6)
    wa, wb = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


def test_a_run_with_the_single_fit_of_before_refits_resumes_on_its_schedule():
    # --steps 40, warmup 2, one fit at 7 to 30: the old schedule was the cosine of 30 steps
    fits = recorded_fits({"budget_fit": dict(at_step=7, requested_steps=40, steps=30, step_s=0.1,
                                             eval_s=1.0, checkpoint_s=0.0)}, warmup_steps=2)  # fmt: skip
    assert fits[0].progress == pytest.approx(5 / 28)
    for step in range(7, 31):
        got = progress_at(step, warmup_steps=2, requested_steps=40, fits=fits)
        assert got == pytest.approx(min((step - 2) / 28, 1.0))


def test_a_generous_budget_keeps_the_requested_steps(corpus, tmp_path):
    cfg = tiny_train(corpus, steps=20, time_budget_s=1e6, fit_to_budget=True)
    result = loop.train(tiny_model(), cfg, tmp_path / "run", progress=False)
    fits = json.loads((tmp_path / "run" / "run.json").read_text())["budget_fits"]
    assert result.step == 20 and [(f["at_step"], f["steps"]) for f in fits] == [(15, 20)]
    fit = fits[0]
    assert fit["step_s"] > 0 and fit["eval_s"] > 0


def test_the_kernels_first_build_is_kept_off_the_clock(corpus, tmp_path, monkeypatch):
    # A fresh environment builds the fused kernel on first use (30-40 s). Were that in
    # the step-0 validation, the fit would charge it to every later validation and cut steps.
    real, calls = cpu_kernel.kernel, []

    def first_build(*args):
        if not calls:
            time.sleep(1.0)
        calls.append(time.perf_counter())
        return real()

    monkeypatch.setattr(cpu_kernel, "kernel", first_build)
    # validations at steps 0 and 20 only: the fit at step 15 costs the step-0 one
    cfg = tiny_train(corpus, steps=20, time_budget_s=1e6, fit_to_budget=True, eval_every=100)
    result = loop.train(tiny_model(), cfg, tmp_path / "run", progress=False)
    fit = json.loads((tmp_path / "run" / "run.json").read_text())["budget_fits"][0]
    assert result.step == 20 and calls and 0 < fit["eval_s"] < 1.0
