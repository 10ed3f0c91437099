"""Paired per-seed differences for the benchmarks that print their tables: every arm against
a baseline arm scored on the same seeds and the same held-out set (``TrainConfig.split_seed``
fixed), as mean ± sd of the differences with the paired t-interval and the percentile
bootstrap interval (:mod:`moelab.utils.results`), and the per-seed differences themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moelab.utils.results import bootstrap_interval, t_interval


def paired_line(values: Sequence[float], baseline: Sequence[float], scale: float = 1.0) -> str:
    """``"Δ +0.0123 ± 0.0040 (t95 [+0.002, +0.022], boot95 [+0.008, +0.016]; per seed
    +0.010 +0.012 +0.015)"`` of ``values − baseline`` seed by seed, times ``scale``; with
    one seed, the difference alone.

    Raises:
        ValueError: the two lists differ in length (not paired).
    """
    if len(values) != len(baseline):
        raise ValueError(f"paired_line: {len(values)} values against {len(baseline)} baselines")
    diffs = [(v - b) * scale for v, b in zip(values, baseline, strict=True)]
    per_seed = " ".join(f"{d:+.4f}" for d in diffs)
    st = t_interval(diffs)
    if st.sd is None:
        return f"Δ {st.mean:+.4f} (one seed)"
    lo, hi = bootstrap_interval(diffs)
    return (
        f"Δ {st.mean:+.4f} ± {st.sd:.4f} (t95 [{st.ci[0]:+.4f}, {st.ci[1]:+.4f}], "
        f"boot95 [{lo:+.4f}, {hi:+.4f}]; per seed {per_seed})"
    )


def paired_block(
    rows: Mapping[str, Sequence[float]], baseline: str, scale: float = 1.0, width: int = 62
) -> list[str]:
    """One :func:`paired_line` per row other than ``baseline``, labelled ``"row − baseline"``."""
    return [
        f"  {key + ' − ' + baseline:<{width}} {paired_line(vals, rows[baseline], scale)}"
        for key, vals in rows.items()
        if key != baseline
    ]
