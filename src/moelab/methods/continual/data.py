"""The labelled texts behind the named streams.

* ``"wordnet"``: noun glosses labelled by their depth-5 hypernym ancestor
  (:func:`moelab.data.wordnet.load_wordnet_hypernyms`, Debian ``wordnet-base``), keeping the
  ``num_classes`` ancestors with the most synsets (ties by name) [I]. The note's "110
  ancestors with ≥ 100 descendants, 108 names" could not be re-derived: moelab's loader
  finds 87 ancestors with ≥ 100 synsets, so the 108 largest are taken (the smallest has 78
  synsets; 40 train + 10 test are drawn per class).
* ``"synthetic"``: random texts whose words come from a per-class vocabulary, for tests.
"""

from __future__ import annotations

import random

from moelab.data.labelled import LabelledText
from moelab.errors import InvalidValueError

STREAMS = ("wordnet", "synthetic")


def largest_classes(data: LabelledText, n: int) -> LabelledText:
    """The ``n`` classes with the most examples (ties broken by name), renumbered by name.

    Raises:
        InvalidValueError: the data has fewer than ``n`` classes.
    """
    counts = data.class_counts()
    if len(counts) < n:
        raise InvalidValueError(f"{data.source}: {len(counts)} classes, fewer than {n}")
    ranked = sorted(range(len(counts)), key=lambda c: (-counts[c], data.label_names[c]))
    keep = set(ranked[:n])
    pairs = [(t, data.label_names[y]) for t, y in data if y in keep]
    return LabelledText.from_names([t for t, _ in pairs], [y for _, y in pairs], data.source)


def synthetic_texts(
    num_classes: int, per_class: int, seed: int = 0, words_per_class: int = 6
) -> LabelledText:
    """``per_class`` texts of 5–8 words per class: mostly words of the class's own vocabulary
    (``c{class}w{k}``), one shared filler word each."""
    rng = random.Random(seed)
    texts, names = [], []
    for c in range(num_classes):
        vocab = [f"c{c}w{k}" for k in range(words_per_class)]
        for _ in range(per_class):
            words = [*rng.choices(vocab, k=rng.randint(4, 7)), f"filler{rng.randrange(5)}"]
            rng.shuffle(words)
            texts.append(" ".join(words))
            names.append(f"class{c:03d}")
    return LabelledText.from_names(texts, names, "synthetic")


def load_stream_data(stream: str, num_classes: int, per_class: int) -> LabelledText:
    """The labelled texts of the named stream with ``num_classes`` classes.

    Raises:
        InvalidValueError: an unknown stream name.
        CorpusNotInstalledError: ``wordnet-base`` is missing (says the apt-get command).
    """
    if stream == "wordnet":
        from moelab.data.wordnet import load_wordnet_hypernyms

        return largest_classes(load_wordnet_hypernyms(depth=5, min_synsets=1), num_classes)
    if stream == "synthetic":
        return synthetic_texts(num_classes, per_class)
    raise InvalidValueError(f"stream: must be one of {', '.join(STREAMS)}, got {stream!r}")
