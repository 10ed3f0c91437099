"""MkDocs hook: replace result directives in pages with tables and plots rendered from the
result files in ``docs/results/`` (see ``docs/render_results.py`` for the directives).

Plots are drawn once per build (``on_files``) and added to the site as generated PNG files under
``assets/results/``, so pages link to them like to any image and ``mkdocs build --strict`` checks
those links. A directive naming a missing result file, or an unknown directive, fails the build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import posixpath
import re
import shlex
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from moelab.utils.results import ResultFileError, load_result

DOCS = Path(__file__).resolve().parents[1]
RESULTS = DOCS / "results"
DIRECTIVE = re.compile(r"^<!--\s*result:(\w+)\s+(.*?)\s*-->\s*$", re.MULTILINE)
_KINDS = {"seeds", "summary", "paired", "plot"}


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results", DOCS / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _renderer()


def parse(kind: str, args: str, where: str) -> tuple[list[str], dict[str, str]]:
    """Split a directive's arguments into result names and ``key=value`` options."""
    if kind not in _KINDS:
        raise PluginError(f"{where}: unknown result directive {kind!r} (one of {sorted(_KINDS)})")
    names, options = [], {}
    for token in shlex.split(args):
        if "=" in token:
            key, value = token.split("=", 1)
            options[key] = value
        else:
            names.append(token)
    if not names:
        raise PluginError(f"{where}: result:{kind} names no result file")
    if kind == "seeds" and len(names) != 1:
        raise PluginError(f"{where}: result:seeds takes one result, got {names}")
    if kind == "plot" and "metric" not in options:
        raise PluginError(f"{where}: result:plot needs metric=NAME")
    return names, options


def load(names: list[str], where: str):
    out = []
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise PluginError(f"{where}: no result file docs/results/{name}.json")
        try:
            out.append(load_result(path))
        except ResultFileError as e:
            raise PluginError(f"{where}: {e}") from None
    return out


def plot_uri(names: list[str], options: dict[str, str]) -> str:
    key = hashlib.sha1(repr((names, sorted(options.items()))).encode()).hexdigest()[:10]
    return f"assets/results/{names[0]}-{options['metric']}-{key}.png"


def on_files(files: Files, config) -> Files:
    """Draw every plot a page asks for and add it to the site."""
    done = set()
    for file in list(files.documentation_pages()):
        if file.abs_src_path is None:
            continue
        text = Path(file.abs_src_path).read_text(encoding="utf-8")
        for m in DIRECTIVE.finditer(text):
            if m.group(1) != "plot":
                continue
            names, options = parse("plot", m.group(2), file.src_uri)
            uri = plot_uri(names, options)
            if uri in done:
                continue
            done.add(uri)
            png = render.plot_png(load(names, file.src_uri), options["metric"], options.get("x"))
            files.append(File.generated(config, uri, content=png))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    where = page.file.src_uri

    def replace(m: re.Match) -> str:
        kind = m.group(1)
        names, options = parse(kind, m.group(2), where)
        fmt = options.get("fmt", ".4f")
        metrics = options["metrics"].split(",") if "metrics" in options else None
        if kind == "plot":
            uri = posixpath.relpath(plot_uri(names, options), posixpath.dirname(where) or ".")
            return f"![{options['metric']} of {', '.join(names)}]({uri})"
        results = load(names, where)
        if kind == "seeds":
            return render.seeds_table(results[0], metrics, fmt)
        if kind == "summary":
            return render.summary_table(results, metrics, fmt)
        return render.paired_table(results, metrics, fmt)

    return DIRECTIVE.sub(replace, markdown)
