import base64
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from moelab.analysis import analyze, plot_all, write_report
from moelab.analysis.report import EXPLANATIONS, PNG_MAGIC

CHROMIUM = Path("/usr/bin/chromium")


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs: list[str] = []
        self.tags: list[str] = []
        self.rows = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])
        if tag == "tr":
            self.rows += 1

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def report(tmp_path_factory, make_synthetic_run):
    records, domains, hidden, outputs = make_synthetic_run()
    out = analyze(records, domains, ["code", "prose"], hidden, outputs)
    d = tmp_path_factory.mktemp("report")
    pngs = plot_all(out, d / "plots")
    html_path = write_report(out, pngs, d / "report.html", title="Test <report>")
    return out, pngs, html_path


def test_plots_are_written(report):
    _, pngs, _ = report
    names = sorted(p.name for p in pngs)
    assert names == sorted(EXPLANATIONS)  # all five plots apply to a 3-layer run with domains
    for p in pngs:
        assert p.read_bytes().startswith(PNG_MAGIC)
        assert p.stat().st_size > 5000


def test_report_embeds_every_plot_and_is_self_contained(report):
    out, pngs, html_path = report
    text = html_path.read_text(encoding="utf-8")
    parser = _Collector()
    parser.feed(text)
    parser.close()
    assert len(parser.imgs) == len(pngs)
    for src in parser.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1], validate=True).startswith(PNG_MAGIC)
    assert "script" not in parser.tags and "link" not in parser.tags
    assert "http://" not in text and "https://" not in text
    assert parser.rows == 1 + out["num_layers"]  # header + one row per layer
    body = " ".join(parser.text)
    assert "Test <report>" in body  # title escaped in the source, intact when parsed
    for caption, explanation in EXPLANATIONS.values():
        assert caption in body and explanation in body


def test_single_layer_without_domains_skips_transition_and_domain_plots(
    tmp_path, make_synthetic_run
):
    records = make_synthetic_run(num_layers=1)[0]
    out = analyze(records)
    pngs = plot_all(out, tmp_path)
    assert sorted(p.name for p in pngs) == ["coactivation.png", "entropy.png", "load_heatmap.png"]
    html_path = write_report(out, pngs, tmp_path / "r.html")
    parser = _Collector()
    parser.feed(html_path.read_text())
    assert len(parser.imgs) == 3


def test_write_report_rejects_a_non_png(tmp_path, report):
    out = report[0]
    fake = tmp_path / "fake.png"
    fake.write_bytes(b"GIF89a....")
    with pytest.raises(ValueError, match="not a PNG"):
        write_report(out, [fake], tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_headless_browser_screenshot(report, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: no headless browser to render the report")
    shot = tmp_path / "report.png"
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--window-size=1200,3000",
        f"--screenshot={shot}",
        report[2].resolve().as_uri(),
    ]
    subprocess.run(cmd, check=True, timeout=60, capture_output=True)
    assert shot.read_bytes().startswith(PNG_MAGIC)
    assert shot.stat().st_size > 10_000
