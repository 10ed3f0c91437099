"""Value checks that need a host sync, off the hot path by default.

A check that reads tensor *values* on the host (``bool(isfinite(x).all())``,
``int(ids.max())``) blocks the Python thread until the accelerator has finished all queued
work, so the forward pass of :class:`moelab.core.layer.MoELayer` and
:class:`moelab.models.MoETransformer` runs none of them by default. Turn them on to debug
NaNs or bad token ids:

- ``moelab.core.checks.enable(True)`` (or the context manager :func:`enabled`);
- the environment variable ``MOELAB_DEBUG_CHECKS=1``;
- ``moelab --debug ...`` on the command line.

Shape and dtype checks never sync and always run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def _from_env() -> bool:
    return os.environ.get("MOELAB_DEBUG_CHECKS", "") not in ("", "0", "false", "False")


_ENABLED = _from_env()


def value_checks() -> bool:
    """True when the syncing value checks (finiteness, id ranges) run in forward."""
    return _ENABLED


def enable(flag: bool = True) -> None:
    """Turn the syncing value checks on or off for the whole process."""
    global _ENABLED
    _ENABLED = bool(flag)


def reset() -> None:
    """Back to the default: on iff ``MOELAB_DEBUG_CHECKS`` is set."""
    enable(_from_env())


@contextmanager
def enabled(flag: bool = True) -> Iterator[None]:
    """``with enabled(): ...`` runs the block with the value checks on (then restores)."""
    global _ENABLED
    before = _ENABLED
    _ENABLED = bool(flag)
    try:
        yield
    finally:
        _ENABLED = before
