"""Run the ``moelab`` CLI in this process with one fault injected at an exact point.

Usage::

    python inject.py ACTION MODULE:FUNCTION N WHEN -- <moelab arguments>

The N-th call (1-based) of ``MODULE.FUNCTION`` (patched in that module's namespace, where
callers look it up; ``MODULE:CLASS.METHOD`` patches a method on its class) triggers ACTION
``before`` or ``after`` the real call:

- ``kill``: SIGKILL this process (no handler, no cleanup: a power cut as far as files go);
- ``term`` / ``int``: send SIGTERM / SIGINT to this process and carry on;
- ``stop``: SIGSTOP this process (the test continues it with SIGCONT);
- ``enospc``: raise ``OSError(ENOSPC)`` (a full disk, where mounting a tmpfs is not allowed);
- ``raise``: raise ``RuntimeError("injected fault")`` (a bug at that point);
- ``sleep:SECONDS``: sleep that long (slow work at that point).

``ACTION none`` runs the CLI unchanged. Used by tests/reliability only.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import time


def _fault(action: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "int":
        os.kill(os.getpid(), signal.SIGINT)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    elif action == "raise":
        raise RuntimeError("injected fault")
    elif action.startswith("sleep:"):
        time.sleep(float(action.removeprefix("sleep:")))
    else:
        raise SystemExit(f"inject.py: unknown action {action!r}")


def main(argv: list[str]) -> None:
    action, target, n, when, sep, *cli_args = argv
    assert sep == "--" and when in ("before", "after"), argv
    if action != "none":
        mod_name, attr = target.split(":")
        owner = importlib.import_module(mod_name)
        *classes, func_name = attr.split(".")
        for c in classes:
            owner = getattr(owner, c)
        real = getattr(owner, func_name)
        calls = [0]

        def wrapper(*args, **kwargs):
            calls[0] += 1
            hit = calls[0] == int(n)
            if hit and when == "before":
                _fault(action)
            out = real(*args, **kwargs)
            if hit and when == "after":
                _fault(action)
            return out

        setattr(owner, func_name, wrapper)
    from moelab.cli import app

    sys.argv = ["moelab", *cli_args]
    app()


if __name__ == "__main__":
    main(sys.argv[1:])
