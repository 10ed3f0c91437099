"""Sampling the flow ODE ``dx/dt = v(x, t)`` from t = 0 to 1, with classifier-free guidance.

Classifier-free guidance (Ho & Salimans, arXiv 2207.12598, applied to velocities as the
authors' ``get_velocity`` does): ``v = v_uncond + w·(v_cond − v_uncond)``; w = 1 is the
conditional velocity and needs one function evaluation (NFE) per step, any other w two.

:func:`euler_sample` is the sampler the authors' ``sampling.py`` runs (Euler, step 1/n, on
``linspace(0, 1, n)``: for n >= 2 it evaluates the velocity at t = 0, 1/n, ..., (n−1)/n; their
n = 1 gives a one-point grid and returns the noise unchanged; their released default, n = 2,
is ``steps=2`` here; ``wave3-science.md`` §3.2). :func:`odeint_sample` hands the same guided velocity
to ``torchdiffeq`` (MIT, optional) for adaptive higher-order solvers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from moelab.errors import InvalidValueError, MissingDependencyError

Velocity = Callable[[Tensor, float, bool], Tensor]
"""``velocity(x, t, conditional) -> dx/dt``, same shape as ``x``; ``conditional=False``
gives the unconditional velocity."""


@dataclass(frozen=True)
class Sample:
    """An ODE solution: ``x`` at t = 1 and the number of velocity evaluations it took."""

    x: Tensor
    nfe: int


def cfg_velocity(v_cond: Tensor, v_uncond: Tensor, guidance: float) -> Tensor:
    """``v_uncond + w·(v_cond − v_uncond)`` with w = ``guidance``."""
    return v_uncond + guidance * (v_cond - v_uncond)


class _Guided:
    """The guided velocity as one function of (t, x), counting evaluations."""

    def __init__(self, velocity: Velocity, guidance: float) -> None:
        self.velocity = velocity
        self.guidance = guidance
        self.nfe = 0

    def __call__(self, t: float, x: Tensor) -> Tensor:
        v_cond = self.velocity(x, t, True)
        self.nfe += 1
        if self.guidance == 1.0:
            return v_cond
        v_uncond = self.velocity(x, t, False)
        self.nfe += 1
        return cfg_velocity(v_cond, v_uncond, self.guidance)


def _check(steps: int | None, guidance: float) -> None:
    if steps is not None and not (isinstance(steps, int) and steps >= 1):
        raise InvalidValueError(f"steps: must be an int >= 1, got {steps!r}")
    if not guidance >= 0:
        raise InvalidValueError(f"guidance: must be >= 0, got {guidance!r}")


@torch.no_grad()
def euler_sample(velocity: Velocity, x0: Tensor, steps: int, guidance: float = 1.0) -> Sample:
    """Explicit Euler on the uniform grid: ``x ← x + (1/n)·v(x, k/n)`` for k = 0..n−1.

    Args:
        velocity: see :data:`Velocity`.
        x0: the noise at t = 0.
        steps: n >= 1.
        guidance: CFG scale w >= 0 (1: conditional only).
    Returns:
        :class:`Sample` with ``nfe = n`` (w = 1) or ``2n``.
    Raises:
        InvalidValueError: ``steps < 1`` or ``guidance < 0``.
    """
    _check(steps, guidance)
    field = _Guided(velocity, guidance)
    x, dt = x0, 1.0 / steps
    for k in range(steps):
        x = x + dt * field(k * dt, x)
    return Sample(x, field.nfe)


@torch.no_grad()
def odeint_sample(
    velocity: Velocity,
    x0: Tensor,
    guidance: float = 1.0,
    *,
    method: str = "dopri5",
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> Sample:
    """Solve the guided ODE with ``torchdiffeq.odeint`` (adaptive ``dopri5`` by default).

    Raises:
        MissingDependencyError: torchdiffeq is not installed.
        InvalidValueError: ``guidance < 0``.
    """
    _check(None, guidance)
    try:
        from torchdiffeq import odeint
    except ImportError:
        raise MissingDependencyError(
            "higher-order flow solvers need torchdiffeq; install it with: pip install torchdiffeq"
        ) from None
    field = _Guided(velocity, guidance)
    times = torch.tensor([0.0, 1.0], dtype=x0.dtype, device=x0.device)
    path = odeint(lambda t, x: field(float(t), x), x0, times, method=method, rtol=rtol, atol=atol)
    return Sample(path[-1], field.nfe)
