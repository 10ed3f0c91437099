"""MkDocs hook: the Python API reference, one page per public package of ``src/moelab``.

Each page holds a ``::: module`` block (rendered by mkdocstrings from the docstrings) for every
public module of its package, so a new module appears in the reference without editing the docs.
Modules and packages whose name starts with ``_`` are private and left out; so is ``moelab.cli``,
whose reference is the CLI page (``cli_reference.py``). The pages are generated in memory at build
time (``File.generated``) and listed under "Reference → Python API" in the navigation.
"""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "reference/api"
_SKIP = {"moelab.cli"}
# Docstrings mark references Sphinx-style (:class:`~a.b.C`); Markdown renders the role as text
# before the code span, so the reference pages drop the role and the "~".
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):<code>~?")


def _public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split(".")) and not any(
        name == s or name.startswith(s + ".") for s in _SKIP
    )


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def packages() -> dict[str, list[str]]:
    """``{package: [modules]}`` of ``src/moelab``: each public package (a folder with an
    ``__init__.py``) with the public modules directly inside it, in file-name order. The top
    package ``moelab`` also lists the leaf modules at its top level (``moelab.errors``)."""
    out: dict[str, list[str]] = {}
    for init in sorted((SRC / "moelab").rglob("__init__.py")):
        pkg = _module_name(init)
        if not _public(pkg):
            continue
        modules = [
            _module_name(p)
            for p in sorted(init.parent.glob("*.py"))
            if p.name != "__init__.py" and _public(_module_name(p))
        ]
        out[pkg] = modules
    return out


def page_markdown(pkg: str, modules: list[str]) -> str:
    """The page of one package: its own docstring, then each module's public members."""
    lines = [f"# `{pkg}`", "", f"::: {pkg}", "    options:", "      members: false"]
    lines += ["      show_root_heading: false", ""]
    for mod in modules:
        lines += [f"::: {mod}", ""]
    return "\n".join(lines)


def _uri(pkg: str) -> str:
    return f"{ROOT}/{pkg}.md"


def index_markdown(pkgs: dict[str, list[str]]) -> str:
    lines = [
        "# Python API",
        "",
        "Generated from the docstrings of `src/moelab` at build time, one page per package. "
        "The names most users need are re-exported from the top package and from "
        "`moelab.models`, `moelab.serve`, `moelab.interop`, `moelab.compress` and "
        "`moelab.parallel`.",
        "",
        "| package | modules |",
        "|---|---|",
    ]
    for pkg, modules in pkgs.items():
        short = ", ".join(f"`{m.rsplit('.', 1)[1]}`" for m in modules) or "—"
        lines.append(f"| [`{pkg}`]({pkg}.md) | {short} |")
    return "\n".join(lines) + "\n"


def on_config(config):
    """Put the generated pages under "Reference → Python API" in the navigation."""
    pkgs = packages()
    entries = [f"{ROOT}/index.md"] + [{pkg: _uri(pkg)} for pkg in pkgs]
    for section in config.nav:
        if isinstance(section, dict) and "Reference" in section:
            for item in section["Reference"]:
                if isinstance(item, dict) and "Python API" in item:
                    item["Python API"] = entries
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    pkgs = packages()
    files.append(File.generated(config, f"{ROOT}/index.md", content=index_markdown(pkgs)))
    for pkg, modules in pkgs.items():
        files.append(File.generated(config, _uri(pkg), content=page_markdown(pkg, modules)))
    return files


def strip_roles(html: str) -> str:
    """``html`` with Sphinx role prefixes before code spans removed."""
    return _ROLE.sub("<code>", html)


def on_page_content(html, page, config, files):
    if page.file.src_uri.startswith(ROOT + "/"):
        return strip_roles(html)
    return html
