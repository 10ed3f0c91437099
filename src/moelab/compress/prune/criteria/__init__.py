"""Expert-pruning criteria, one module each, all with the :class:`Criterion` interface."""

from moelab.compress.prune.criteria.base import Criterion, ScoreCriterion, Selection, top_n
from moelab.compress.prune.criteria.frequency import Frequency
from moelab.compress.prune.criteria.naee import NAEE, SubsetErrors
from moelab.compress.prune.criteria.ragep import (
    SpectralSalience,
    rank01,
    subspace_bases,
    subspace_novelty,
)
from moelab.compress.prune.criteria.reap import REAP
from moelab.compress.prune.criteria.soft_frequency import SoftFrequency
from moelab.errors import InvalidValueError

CRITERIA: dict[str, type[Criterion]] = {
    c.name: c for c in (SpectralSalience, REAP, Frequency, SoftFrequency, NAEE)
}


def build_criterion(name: str, **options) -> Criterion:
    """The criterion called ``name`` (``ragep``, ``reap``, ``frequency``, ``soft-frequency``,
    ``naee``); ``options`` go to its constructor (RaGEP: ``pca_rank``, ``beta``).

    Raises:
        ValueError: unknown name or options.
    """
    if name not in CRITERIA:
        raise InvalidValueError(f"method: must be one of {sorted(CRITERIA)}, got {name!r}")
    try:
        return CRITERIA[name](**options)
    except TypeError as e:
        raise InvalidValueError(f"method {name!r}: {e}") from None


__all__ = [
    "CRITERIA",
    "NAEE",
    "REAP",
    "Criterion",
    "Frequency",
    "ScoreCriterion",
    "Selection",
    "SoftFrequency",
    "SpectralSalience",
    "SubsetErrors",
    "build_criterion",
    "rank01",
    "subspace_bases",
    "subspace_novelty",
    "top_n",
]
