"""Training placement (``--device``): the resolution rules everywhere, and on a machine with a
GPU, that a CUDA run trains like a CPU run and resumes exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from moelab.cli import app
from moelab.train.checkpoint import STATE_FILE
from moelab.train.config import ConfigError
from moelab.train.device import resolve_device
from moelab.train.loop import train

from .conftest import tiny_model, tiny_train

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the refusal where torch sees no GPU")


def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_and_cpu(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu")
    assert resolve_device("auto") == expected == resolve_device(None)


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "", "cuda:0:1", "gpu"])
def test_unknown_specs_are_refused(spec):
    with pytest.raises(ConfigError, match="device: expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_gpu_indices_single_process_and_under_torchrun(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="only 2 CUDA GPU"):
        resolve_device("cuda:2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == torch.device("cuda", 1) == resolve_device("auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # a GPU short: every rank trains on the CPU
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="under torchrun pass --device cuda"):
        resolve_device("cuda:0")
    monkeypatch.setenv("LOCAL_RANK", "2")  # more ranks on this node than GPUs
    with pytest.raises(ConfigError, match="only 2 CUDA GPU"):
        resolve_device("cuda")


@cpu_only
def test_cuda_without_a_gpu_is_one_line_and_writes_nothing(corpus, tmp_path):
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--data", str(corpus), "--out", str(out), "--device", "cuda"]
    )
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: device: cuda asked for, but this torch sees no CUDA GPU (a CPU-only build, "
        "or no driver); use --device cpu"
    ]
    assert not out.exists()


def test_resume_may_name_the_device(corpus, tmp_path):
    """Placement is not a run setting: ``--resume --device`` is accepted (other flags are not)."""
    run = tmp_path / "run"
    train(tiny_model(), tiny_train(corpus), run, progress=False, stop_after=2, device="cpu")
    result = CliRunner().invoke(
        app, ["train", "--out", str(run), "--resume", "--device", "cpu", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6 and (run / "model.safetensors").exists()
    assert "device" not in json.loads((run / "run.json").read_text())["train"]


def _losses(run):
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["split"] == "train"]


@cuda_only
def test_a_cuda_run_trains_like_the_cpu_run(corpus, tmp_path):
    """Same data order (batches are drawn on the host), same init: fp32 results agree to
    rounding after 6 AdamW steps."""
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    train(tiny_model(), tiny_train(corpus), cpu, progress=False, device="cpu")
    train(tiny_model(), tiny_train(corpus), gpu, progress=False, device="cuda")
    assert _losses(gpu) == pytest.approx(_losses(cpu), rel=1e-4)
    wa, wb = load_file(cpu / "model.safetensors"), load_file(gpu / "model.safetensors")
    assert all(t.device.type == "cpu" for t in wb.values())
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-3, atol=1e-4)


@cuda_only
def test_a_cuda_run_resumes_exactly_with_its_device_random_state(corpus, tmp_path):
    """Router jitter draws from the GPU's generator: the checkpoint carries its state, so the
    resumed run repeats the uninterrupted one; and the run can finish on the CPU."""
    model = tiny_model()
    model.moe.router.jitter_eps = 0.1
    full, part, moved = tmp_path / "full", tmp_path / "part", tmp_path / "moved"
    train(model, tiny_train(corpus), full, progress=False, device="cuda")
    train(model, tiny_train(corpus), part, progress=False, stop_after=3, device="cuda")
    last = sorted((part / "checkpoints").glob("step-*"))[-1]
    state = torch.load(last / STATE_FILE, weights_only=True)
    assert state["device_rng"].dtype == torch.uint8
    train(None, None, part, resume=True, progress=False, device="cuda")
    assert _losses(part) == pytest.approx(_losses(full), rel=1e-5)
    train(model, tiny_train(corpus), moved, progress=False, stop_after=3, device="cuda")
    train(None, None, moved, resume=True, progress=False, device="cpu")
    assert len(_losses(moved)) == 6
