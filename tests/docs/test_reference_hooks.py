"""The MkDocs hooks that generate the CLI and API references and the result directives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import typer

from moelab.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    path = ROOT / "docs" / "hooks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"moelab_docs_hook_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cli_reference = _load("cli_reference")
api_reference = _load("api_reference")


def test_escape_keeps_help_text_literal_in_markdown():
    assert cli_reference.escape("runs/<name> a|b *x* [y]") == (
        "runs/&lt;name&gt; a\\|b \\*x\\* \\[y\\]"
    )
    assert cli_reference.inline("merge ``moelab train --lora-rank r`` a_b") == (
        "merge `moelab train --lora-rank r` a\\_b"
    )


def test_cli_page_documents_every_command_and_option():
    page = cli_reference.render()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert f"\n## moelab {name}\n" in page, name
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("--"):
                    assert f"`{opt}" in page, f"{name} {opt}"
    assert "runs/&lt;name&gt;" in page  # moelab train --out's help, escaped
    train = page.split("\n## moelab train\n")[1].split("\n## ")[0]
    assert "**Examples:**\n\n```bash\nmoelab train " in train  # examples as a code block
    assert "\nmoelab train --data shakespeare --experts 16" in train


def test_api_pages_cover_the_public_packages_only():
    pkgs = api_reference.packages()
    assert "moelab" in pkgs and "moelab.errors" in pkgs["moelab"]
    assert "moelab.core.plan" in pkgs["moelab.core"]
    assert "moelab.compress.prune.criteria" in pkgs
    names = [m for mods in pkgs.values() for m in mods] + list(pkgs)
    assert not [n for n in names if n.startswith("moelab.cli")]
    assert not [n for n in names if any(part.startswith("_") for part in n.split("."))]
    page = api_reference.page_markdown("moelab.core", pkgs["moelab.core"])
    assert "::: moelab.core.plan" in page and page.startswith("# `moelab.core`")


def test_sphinx_roles_are_dropped_from_reference_pages():
    html = "see :class:<code>~moelab.core.plan.RoutingPlan</code> and :func:<code>f</code>"
    assert api_reference.strip_roles(html) == (
        "see <code>moelab.core.plan.RoutingPlan</code> and <code>f</code>"
    )


def test_result_directives_are_parsed_and_checked():
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    results = _load("results")
    m = results.DIRECTIVE.search("x\n<!-- result:plot a b metric=val_bpb x=budget_s -->\ny")
    assert m and results.parse(m.group(1), m.group(2), "p.md") == (
        ["a", "b"],
        {"metric": "val_bpb", "x": "budget_s"},
    )
    with pytest.raises(PluginError, match="unknown result directive"):
        results.parse("table", "a", "p.md")
    with pytest.raises(PluginError, match="needs metric"):
        results.parse("plot", "a", "p.md")
    with pytest.raises(PluginError, match="no result file"):
        results.load(["no_such_result"], "p.md")
