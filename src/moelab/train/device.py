"""Where training runs: ``--device auto|cpu|cuda|cuda:N``.

Placement is not a hyperparameter: it is not part of :class:`~moelab.train.config.TrainConfig`
(run.json), and a run may resume on another device. Batches are still sampled on the host
with the loop's CPU generator, so a run sees the same data on every device; the model, its
optimizer state and each batch live on the device.
"""

from __future__ import annotations

import os

import torch

from moelab.train.config import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The training device of this process.

    ``auto`` (or None) is CUDA when ``torch.cuda.is_available()``, else the CPU; under
    ``torchrun`` (``WORLD_SIZE`` > 1) it is CUDA only when the node has a GPU for each of its
    ranks (``LOCAL_WORLD_SIZE``), so that all ranks agree. There ``cuda`` means
    ``cuda:$LOCAL_RANK``, one GPU per rank, as DDP and NCCL expect; an explicit index is
    refused.

    Raises:
        ConfigError: an unknown spec, CUDA asked for where torch sees none, an index past
            the GPUs present, or an index under ``torchrun``.
    """
    spec = "auto" if spec is None else str(spec)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if spec == "auto":
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        spec = "cuda" if gpus >= ranks_here and gpus else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ConfigError(f"device: expected {DEVICE_CHOICES}, got {spec!r}") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ConfigError(f"device: expected {DEVICE_CHOICES}, got {spec!r}")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device: {spec} asked for, but this torch sees no CUDA GPU (a CPU-only build, "
            "or no driver); use --device cpu"
        )
    if distributed:
        if device.index is not None:
            raise ConfigError(
                f"device: {spec} names a GPU; under torchrun pass --device cuda, and each rank "
                "takes cuda:$LOCAL_RANK"
            )
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device: {spec}: only {torch.cuda.device_count()} CUDA GPU(s) present")
    return torch.device("cuda", index)


def device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The device's own random state (router jitter and the diffusion masks draw from it on
    a GPU), to checkpoint next to the CPU's; None on the CPU."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_device_rng_state(device: torch.device, state: torch.Tensor | None) -> None:
    """Restore :func:`device_rng_state` (a state saved on another kind of device is ignored:
    the resumed run then draws a new stream there)."""
    if device.type == "cuda" and state is not None:
        torch.cuda.set_rng_state(state, device)
