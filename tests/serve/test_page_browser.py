"""The routing page in headless Chromium: it streams a completion and colours the tokens."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from .live import live_server

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and
                 Path(p).exists()), None)  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no headless browser: /usr/bin/chromium is not installed (apt-get install chromium)",
    ),
]


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
         "--window-size=1000,700", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_page_shows_tokens_coloured_by_expert(tmp_path):
    import matplotlib.image as mpimg

    with live_server() as (url, engine):
        page = url + "/?prompt=ROMEO:&mode=complete&max_tokens=24&temperature=0&stream=0"
        for _ in range(3):  # a loaded machine can outlast the virtual-time budget: retry
            dom = _chromium("--dump-dom", page)
            assert dom.returncode == 0, dom.stderr[-2000:]
            if 'data-done="24"' in dom.stdout:  # the request finished with 24 tokens
                break
        assert 'data-done="24"' in dom.stdout
        assert engine.stats.generated_tokens >= 24
        spans = re.findall(r'<span class="tok" data-experts="([^"]*)"', dom.stdout)
        assert len(spans) == 24
        assert "background: rgb(" in dom.stdout  # painted
        shot = tmp_path / "page.png"
        res = _chromium(f"--screenshot={shot}", page)
        assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    img = mpimg.imread(shot)[..., :3]  # float RGB in [0, 1]
    assert img.shape[:2] == (700, 1000)
    sat = img.max(-1) - img.min(-1)
    band = sat[110:165]  # the assistant turn under the prompt
    coloured = band > 0.1
    assert coloured.sum() > 500
    # more than one expert colour is visible: distinct hues among the saturated pixels
    px = img[110:165][coloured]
    hues = {tuple((p * 4).round().astype(int)) for p in px}
    assert len(hues) >= 2
    assert np.isfinite(img).all()
