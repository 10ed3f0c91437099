"""Every Python example in the README and the documentation runs.

Convention (docs/contributing-docs.md): each fenced ```python block of ``README.md`` and
``docs/**/*.md`` is executed; the blocks of one page run in order in one namespace, in a fresh
working directory, with one torch thread. A block that cannot run here (downloaded weights, a
trained run, a GPU, a server) carries ``<!-- skip: REASON -->`` on the line directly above its
fence.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)")
SKIP = re.compile(r"^<!--\s*skip:\s*(.*?)\s*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every top-level ```python block; ``line`` is the
    1-based line of the block's first code line, so a traceback's line N is page line
    ``line + N - 1``."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        if lang == "python":
            above = SKIP.match(lines[start - 1]) if start else None
            reason = above.group(1) if above else None
            blocks.append((start + 2, "\n".join(lines[start + 1 : i]), reason))
        i += 1
    return blocks


def _pages_with_examples() -> list[Path]:
    return [p for p in PAGES if python_blocks(p.read_text(encoding="utf-8"))]


def test_block_parser_reads_fences_and_skip_markers():
    text = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "```bash",
            "echo no",
            "```",
            "<!-- skip: needs the SmolLM2 weights -->",
            "```python",
            "b = 2",
            "c = 3",
            "```",
            "    ```python",  # indented: not a top-level fence
        ]
    )
    assert python_blocks(text) == [
        (2, "a = 1", None),
        (9, "b = 2\nc = 3", "needs the SmolLM2 weights"),
    ]


def test_skip_markers_give_a_reason():
    for page in PAGES:
        for line_no, _, reason in python_blocks(page.read_text(encoding="utf-8")):
            assert reason != "", f"{page.relative_to(ROOT)}:{line_no}: skip marker without a reason"


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # a real module, as a script's __main__ is: dataclasses and pickling look classes up there
    module = types.ModuleType("__docs_example__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    try:
        for line_no, code, reason in python_blocks(page.read_text(encoding="utf-8")):
            if reason is not None:
                continue
            where = f"{page.relative_to(ROOT)}:{line_no}"
            exec(compile(code, where, "exec"), namespace)
    finally:
        torch.set_num_threads(threads)


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []
