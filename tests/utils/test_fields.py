import math
from dataclasses import dataclass
from typing import Literal

import pytest

from moelab.utils.fields import MAX_INT, check_fields


@dataclass
class C:
    n: int = 1
    x: float = 1.0
    b: bool = False
    s: str = "a"
    mode: Literal["p", "q"] = "p"
    opt: float | None = None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(n=2.0), "n: must be an integer, got 2.0"),
        (dict(n=True), "n: must be an integer"),
        (dict(n=MAX_INT + 1), "n: must be at most"),
        (dict(x=math.inf), "x: must be a finite number, got inf"),
        (dict(x=math.nan), "x: must be a finite number"),
        (dict(x="1"), "x: must be a number"),
        (dict(b=1), "b: must be true or false"),
        (dict(s=3), "s: must be a string"),
        (dict(mode="r"), "mode: must be one of 'p', 'q'"),
        (dict(opt=math.inf), "opt: must be a finite number"),
    ],
)
def test_bad_values_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        check_fields(C(**kw))


def test_good_values_pass():
    check_fields(C(n=-3, x=2, opt=None))
    check_fields(C(x=0.5, opt=3, mode="q"))
