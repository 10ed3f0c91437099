import pytest
import torch

from moelab.errors import InvalidTypeError, InvalidValueError
from moelab.methods.forecasting.text import TextCache, TextCacheError, zscore_stats


class Counting:
    def __init__(self):
        self.seen = []

    def __call__(self, texts):
        self.seen += texts
        return torch.tensor([[float(len(t)), float(t.count("a"))] for t in texts])


def test_cache_encodes_each_distinct_string_once(tmp_path):
    enc = Counting()
    path = tmp_path / "c.safetensors"
    cache = TextCache("fake", encode=enc, path=path)
    v = cache.encode(["aa", "b", "aa", ""])
    assert enc.seen == ["aa", "b"]
    assert v.tolist() == [[2.0, 2.0], [1.0, 0.0], [2.0, 2.0], [0.0, 0.0]]
    cache.encode(["b", "cab"])
    assert enc.seen == ["aa", "b", "cab"] and cache.calls == 3 and len(cache) == 3
    again = TextCache("fake", encode=enc, path=path)  # read back from the file
    assert again.encode(["cab", "aa"]).tolist() == [[3.0, 1.0], [2.0, 2.0]]
    assert again.calls == 0
    with pytest.raises(TextCacheError, match="encoder 'fake', not 'smollm2'"):
        TextCache("smollm2", path=path)
    (tmp_path / "bad.safetensors").write_bytes(b"junk")
    with pytest.raises(TextCacheError, match="not a text cache"):
        TextCache("fake", path=tmp_path / "bad.safetensors")


def test_cache_bad_input():
    cache = TextCache("fake", encode=Counting())
    with pytest.raises(InvalidTypeError):
        cache.encode("one string")
    with pytest.raises(InvalidValueError, match="empty list"):
        cache.encode([])
    with pytest.raises(InvalidValueError, match="only empty strings"):
        cache.encode([""])


def test_zscore_stats_by_hand():
    v = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    mean, std = zscore_stats(v)
    assert mean.tolist() == [2.0, 5.0]
    assert std.tolist() == [1.0, 1.0]  # population std 1; the constant dimension gets 1
    assert ((v - mean) / std).tolist() == [[-1.0, 0.0], [1.0, 0.0]]
