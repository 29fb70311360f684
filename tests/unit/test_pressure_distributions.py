"""The simulator's service-time distributions (issue 29's scenarios): each has the
stage's mean, the tails they are chosen for, and the profile refuses any other."""

from __future__ import annotations

import random
import statistics

import pytest

from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.pressure.simulate import SERVICE_KINDS, InvalidProfile, profile_from, service_time

MEAN_S = 0.02


@pytest.mark.parametrize(("kind", "p99_over_mean"), [
    ("fixed", (1.0, 1.0)), ("exp", (4.4, 4.8)), ("lognormal", (5.5, 7.5)),
    ("bimodal", (3.0, 3.0))])
def test_each_distribution_has_the_stage_s_mean_and_its_own_tail(
        kind: str, p99_over_mean: tuple[float, float]) -> None:
    rng = random.Random(29)
    draws = sorted(service_time(rng, kind, MEAN_S) for _ in range(100_000))
    assert statistics.fmean(draws) == pytest.approx(MEAN_S, rel=0.03)
    low, high = p99_over_mean
    assert low * 0.98 <= draws[98_999] / MEAN_S <= high * 1.02
    assert min(draws) > 0


def test_the_profile_takes_every_kind_and_refuses_others() -> None:
    pipeline = pipeline_from("p", {"stages": [{"name": "s", "match": {"header": "s"}}]}, "p")
    base = {"steps": [{"at_s": 0, "rps": 10}], "service_ms": {"s": 20}}
    for kind in SERVICE_KINDS:
        assert profile_from({**base, "service": kind}, pipeline).service == kind
    with pytest.raises(InvalidProfile, match="service must be one of fixed, exp, "
                                             "lognormal, bimodal, got 'pareto'"):
        profile_from({**base, "service": "pareto"}, pipeline)
