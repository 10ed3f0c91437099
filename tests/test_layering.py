"""Dependencies point downwards (DESIGN.md): errors/utils ← core, data ← models ←
{train, analysis, compress, serve, parallel, interop, methods} ← cli. No module imports a
higher layer, not even lazily inside a function; recipes (``methods``) sit above their
siblings: they may import train/analysis/..., but only ``cli`` imports them. No ``assert``
validates anything in src."""

from __future__ import annotations

import ast
from pathlib import Path

import moelab

SRC = Path(moelab.__file__).parent
RANK = {
    "errors": 0, "utils": 0,
    "core": 1, "data": 1,
    "models": 2,
    "train": 3, "analysis": 3, "compress": 3, "serve": 3, "parallel": 3, "interop": 3,
    "methods": 3,
    "cli": 4,
}  # fmt: skip


def _imported(tree):
    """Every ``moelab.<pkg>`` module an AST imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            if node.module == "moelab":  # from moelab import methods
                yield from (f"moelab.{a.name}" for a in node.names)


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        if len(parts) == 1:  # moelab/__init__.py re-exports the core API
            continue
        yield path, parts[0], ast.parse(path.read_text())


def test_no_module_imports_a_higher_layer():
    bad = []
    for path, pkg, tree in _modules():
        if pkg not in RANK:
            continue
        for name in _imported(tree):
            parts = name.split(".")
            if parts[0] == "moelab" and len(parts) > 1:
                target = parts[1].removesuffix(".py")
                if RANK.get(target, -1) > RANK[pkg]:
                    bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert bad == []


def test_only_the_cli_imports_recipes():
    bad = [
        f"{path.relative_to(SRC)} imports {name}"
        for path, pkg, tree in _modules()
        if pkg not in ("methods", "cli")
        for name in _imported(tree)
        if name == "moelab.methods" or name.startswith("moelab.methods.")
    ]
    assert bad == []


def test_models_no_longer_hold_pretrained_loading():
    assert not (SRC / "models" / "pretrained.py").exists()
    from moelab.errors import UserError
    from moelab.interop.pretrained import PRETRAINED, PretrainedNotInstalledError

    assert "smollm2" in PRETRAINED and issubclass(PretrainedNotInstalledError, UserError)


def test_no_assert_statements_in_src():
    found = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path, _, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert)
    ]
    assert found == []
