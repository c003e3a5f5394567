"""Papers' ranking claims judged on per-seed suite scores: the rule, its verdicts, and its errors."""
import math
import statistics

import pytest

from posattn.claims import SIGMAS, Judged, Relation, combine, judge, judge_relation, parse_claims


def claim(*holds: str) -> list:
    errors: list[str] = []
    out = parse_claims([{"claim": "c", "paper": "p", "holds": list(holds)}], errors)
    assert not errors
    return out[0]


STATS = {"low": [60.0, 61.0, 59.0], "mid": [65.0, 66.0, 64.0], "same_as_mid": [64.5, 66.5, 65.0],
         "high": [70.0, 71.0, 69.5], "one_seed": [80.0]}


def test_difference_and_its_standard_error_are_those_of_two_independent_means():
    j = judge_relation(Relation("high", ">", "mid"), STATS)
    a, b = STATS["high"], STATS["mid"]
    se = math.sqrt(statistics.variance(a) / 3 + statistics.variance(b) / 3)
    assert isinstance(j, Judged) and j.diff == pytest.approx(statistics.fmean(a) - statistics.fmean(b))
    assert j.se == pytest.approx(se) and j.diff > SIGMAS * se and j.status == "holds"


@pytest.mark.parametrize("holds, verdict", [
    (["high > mid", "mid > low"], "reproduced"),
    (["high > mid", "low > mid"], "not reproduced"),                       # a clear difference the other way
    (["high > mid", "same_as_mid > mid"], "not distinguishable at this scale"),
    (["same_as_mid !> mid"], "reproduced"),                                # "adds nothing": no gain that counts
    (["high !> low"], "not reproduced"),
    (["high > one_seed"], "not measured"),
    (["high > absent"], "not measured"),
])
def test_verdicts(holds, verdict):
    got, lines = judge(claim(*holds), STATS)
    assert got == verdict and len(lines) == len(holds)


def test_every_bad_claim_is_reported():
    errors: list[str] = []
    parse_claims([{"claim": "x", "paper": "y", "holds": ["a >> b", "a > a", "a > b"]},
                  {"claim": "x", "holds": ["a > b"]}, "not a mapping"], errors)
    assert len(errors) == 4 and "'a >> b'" in errors[0] and "'a > a'" in errors[1]
    assert "claims[1]" in errors[2] and "claims[2]" in errors[3]


def test_labels_with_spaces_and_thresholds():
    assert Relation.parse("cat (1L) !> rope (2L)") == Relation("cat (1L)", "!>", "rope (2L)")
    assert Relation.parse("absolute (2L) >= 0.99") == Relation("absolute (2L)", ">=", "0.99")
    assert Relation.parse("absolute (2L) >= rope (2L)") is None        # >= takes a number
    stats = {"a": [0.99, 1.0, 0.995], "b": [0.90, 0.95, 0.92], "c": [0.97, 0.99, 1.0]}
    assert judge(claim("a >= 0.99"), stats)[0] == "reproduced"
    assert judge(claim("b >= 0.99"), stats)[0] == "not reproduced"     # 0.923 ± 0.015: more than 2 s.e. short
    assert judge(claim("c >= 0.99"), stats)[0] == "not distinguishable at this scale"


def test_combine_lets_a_contradiction_anywhere_decide():
    assert combine(["reproduced", "reproduced"]) == "reproduced"
    assert combine(["reproduced", "not distinguishable at this scale"]) == "not distinguishable at this scale"
    assert combine(["reproduced", "not measured"]) == "not measured"
    assert combine(["not measured", "not reproduced", "reproduced"]) == "not reproduced"
    assert combine([]) == "not measured"


def test_at_must_be_a_mapping_and_claims_round_trip():
    errors: list[str] = []
    assert parse_claims([{"claim": "x", "paper": "y", "holds": ["a > b"], "at": [64]}], errors, ("at",)) == []
    assert errors == ["claims[0].at must be a mapping, got [64]"]
    c = parse_claims([{"claim": "x", "paper": "y", "holds": ["a (1L) !> b", "a (1L) >= 0.9"], "at": {"d_model": 64}}],
                     errors, ("at",))[0]
    assert parse_claims([c.to_dict()], errors, ("at",)) == [c] and len(errors) == 1
