"""One self-contained HTML routing report: embedded PNGs, a headline table, plain-language notes.

Every image is inlined as a ``data:image/png;base64`` URI and the style sheet is inline, so the
file reads offline and can be mailed or archived as is. No JavaScript.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path

from moelab.analysis import plots
from moelab.analysis.summary import HEADLINE_KEYS
from moelab.utils.atomic import atomic_write_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

#: Caption and plain-language explanation of each known plot, keyed by file name.
EXPLANATIONS: dict[str, tuple[str, str]] = {
    plots.LOAD_HEATMAP: (
        "Expert load",
        "Each row is a layer, each column an expert; the colour is the share of routed "
        "(token, expert) pairs that expert received. With E experts a perfectly balanced layer "
        "shows 1/E in every cell. Bright cells are overloaded experts, dark cells under-used "
        "ones, and a × marks a dead expert that received no token at all.",
    ),
    plots.ENTROPY: (
        "Router entropy and confidence",
        "Left: the mean entropy of each token's routing distribution in nats; the dashed line "
        "is ln E, the entropy of a router that spreads every token evenly. Right: the same "
        "entropy divided by ln E (1 = undecided, 0 = every token fully committed to one expert) "
        "and the mean gap between the two most likely experts (near 1 = confident choices, near "
        "0 = near-ties between the top two).",
    ),
    plots.COACTIVATION: (
        "Expert co-activation",
        "One panel per layer. Row i, column j is the fraction of the tokens sent to expert i "
        "that were also sent to expert j in the same layer, P(j | i). With top-1 routing this is "
        "empty. Bright off-diagonal cells are experts that are habitually used together, "
        "candidates for co-location or merging.",
    ),
    plots.TRANSITIONS: (
        "Cross-layer pathways",
        "One panel per pair of adjacent layers. Row a, column b is the fraction of the tokens "
        "whose top-1 expert was a in the earlier layer that pick b in the next layer; each row "
        "sums to 1. One bright cell per row means tokens follow fixed expert pathways; flat rows "
        "mean the next layer's choice does not depend on the previous one. The NMI in the "
        "title summarises this from 0 (independent) to 1 (fully determined).",
    ),
    plots.DOMAIN_PREFERENCE: (
        "Domain specialisation",
        "One panel per layer. Each row is a data domain, each column an expert; the colour is "
        "the fraction of that domain's routed pairs that went to the expert (rows sum to 1). "
        "Distinct rows mean experts specialise by domain; identical rows mean routing ignores "
        "the domain. The NMI in the title is 1 when the expert reveals the domain exactly and "
        "0 when it carries no information about it.",
    ),
}

_COLUMN_TITLES = {
    "layer": "layer",
    "num_experts": "E",
    "cv": "load CV",
    "max_over_mean": "max/mean load",
    "num_dead": "dead experts",
    "dropped": "dropped pairs",
    "entropy": "entropy (nats)",
    "normalized_entropy": "entropy / ln E",
    "margin": "top-1 margin",
    "adjacent_consistency": "adjacent same top-1",
    "pathway_nmi_next": "NMI to next layer",
    "domain_nmi": "domain NMI",
    "effective_rank": "effective rank",
    "redundancy": "expert cosine",
}

_TABLE_NOTE = (
    "Load CV is std/mean of the per-expert pair counts (0 = perfectly balanced); max/mean load "
    "is 1 when balanced and E when one expert takes everything. Entropy is the mean routing "
    "entropy per token; the top-1 margin is the mean gap between the two largest router "
    "probabilities. Adjacent same top-1 is the fraction of neighbouring tokens in a sequence "
    "that choose the same top-1 expert (chance level is about 1/E). NMI to next layer measures "
    "how much a token's top-1 expert here predicts its top-1 expert in the next layer; domain "
    "NMI how much the chosen expert reveals the data domain (both 0 to 1). Effective rank is "
    "exp of the entropy of the normalised singular values of the layer's hidden states; expert "
    "cosine is the mean cosine similarity between different experts' outputs on the same "
    "tokens (high = redundant experts). A dash means the input for that column was not given."
)

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1100px; color: #222; line-height: 1.45; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f3f3f3; }
figure { margin: 1em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
p.note, figcaption { color: #444; font-size: 0.92em; }
.meta { color: #666; font-size: 0.9em; }
"""


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.3f}"
    return html.escape(str(v))


def summary_table_html(analysis: dict) -> str:
    """The per-layer headline numbers of ``analysis["headline"]`` as an HTML ``<table>``."""
    head = "".join(f"<th>{html.escape(_COLUMN_TITLES[k])}</th>" for k in HEADLINE_KEYS)
    rows = []
    for row in analysis["headline"]:
        cells = "".join(f"<td>{_fmt(row.get(k))}</td>" for k in HEADLINE_KEYS)
        rows.append(f"<tr>{cells}</tr>")
    return (
        f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody></table>"
    )


def png_data_uri(path: str | os.PathLike) -> str:
    """``data:image/png;base64,...`` of the PNG file at ``path``.

    Raises:
        ValueError: when the file is not a PNG (wrong magic bytes), naming the file.
    """
    data = Path(path).read_bytes()
    if not data.startswith(PNG_MAGIC):
        raise ValueError(f"{path} is not a PNG file (bad magic bytes)")
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def render_report(
    analysis: dict, plot_paths: Sequence[str | os.PathLike], title: str = "moelab routing report"
) -> str:
    """The report's HTML text (see :func:`write_report`)."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{analysis["num_layers"]} MoE layer(s); experts per layer: '
        f"{html.escape(', '.join(str(e) for e in analysis['num_experts']))}."
        + (
            " Domains: " + html.escape(", ".join(analysis["domain_names"])) + "."
            if analysis.get("domain_names")
            else ""
        )
        + "</p>",
        "<h2>Summary per layer</h2>",
        summary_table_html(analysis),
        f'<p class="note">{html.escape(_TABLE_NOTE)}</p>',
    ]
    for p in plot_paths:
        name = Path(p).name
        caption, text = EXPLANATIONS.get(name, (Path(p).stem.replace("_", " "), ""))
        parts.append(f"<h2>{html.escape(caption)}</h2>")
        parts.append("<figure>")
        parts.append(f'<img src="{png_data_uri(p)}" alt="{html.escape(caption)}">')
        if text:
            parts.append(f"<figcaption>{html.escape(text)}</figcaption>")
        parts.append("</figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(
    analysis: dict,
    plot_paths: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    title: str = "moelab routing report",
) -> Path:
    """Write one self-contained HTML report atomically and return its path.

    The report has a per-layer summary table of ``analysis["headline"]`` and, for each PNG in
    ``plot_paths`` (in order), the image embedded as a base64 ``data:image/png`` URI with a
    plain-language explanation of how to read it. No external CSS, JS or image is referenced.

    Args:
        analysis: the dict of :func:`moelab.analysis.analyze`.
        plot_paths: PNG files, e.g. from :func:`moelab.analysis.plots.plot_all`.
        out_path: destination ``.html``; its folder is created if missing.
        title: page title and heading.

    Raises:
        ValueError: when a plot file is not a PNG.
        FileNotFoundError: when a plot file is missing.
    """
    text = render_report(analysis, plot_paths, title)
    return atomic_write_text(out_path, text)
