"""Splitting one global rate among Envoys (sitsmesh.quota.split): whole tokens per
whole-second fill that add up to the rate, in proportion to demand, with a floor."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sitsmesh.quota.split import FLOOR, _no_zero, fill_seconds, split


def test_tokens_add_up_to_the_global_rate_and_follow_demand() -> None:
    shares = split(10.0, 60, {"a": 9.0, "b": 1.0})
    fill = shares["a"].fill_s
    assert shares["b"].fill_s == fill and fill >= 1
    assert shares["a"].tokens_per_fill + shares["b"].tokens_per_fill == round(10.0 * fill)
    assert shares["a"].rate == pytest.approx(9.0, rel=0.1)
    assert shares["b"].rate == pytest.approx(1.0, rel=0.2)


def test_a_new_envoy_gets_an_equal_share_until_it_reports() -> None:
    shares = split(10.0, 60, {"old": 30.0, "new": None})
    # Weights: 30 for the old one, an equal share (5) for the new one.
    assert shares["new"].rate == pytest.approx(10.0 * 5 / 35, rel=0.15)


def test_an_idle_envoy_keeps_a_floor() -> None:
    shares = split(100.0, 60, {"busy": 100.0, "idle": 0.0})
    floor = FLOOR * 100.0 / 2
    assert shares["idle"].rate >= floor * 0.9
    assert shares["busy"].rate + shares["idle"].rate == pytest.approx(100.0, rel=0.01)


def test_a_slow_rate_gets_a_longer_fill_so_every_envoy_has_a_token() -> None:
    # 60 per minute over three Envoys: one token a second in all.
    assert fill_seconds(1.0, 3, 60) == 60
    assert fill_seconds(0.5, 3, 3600) == 200
    shares = split(1.0, 60, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert {s.fill_s for s in shares.values()} == {60}
    assert sum(s.tokens_per_fill for s in shares.values()) == 60
    assert all(s.tokens_per_fill >= 1 for s in shares.values())


def test_a_fill_never_outlasts_the_rules_window_and_is_whole_seconds() -> None:
    # Envoy 1.40 divides by the fill's whole seconds: under 1 s it would divide by 0.
    assert fill_seconds(0.001, 2, 60) == 60
    assert fill_seconds(10_000.0, 2, 1) == 1


def test_more_envoys_than_tokens_still_gives_each_one() -> None:
    shares = split(0.5, 1, {str(i): 1.0 for i in range(5)})
    assert all(s.tokens_per_fill == 1 and s.fill_s == 1 for s in shares.values())
    skewed = split(3.0, 1, {"a": 100.0, "b": 0.0, "c": 0.0})
    assert [skewed[e].tokens_per_fill for e in "abc"] == [1, 1, 1]


def test_burst_is_small_next_to_the_rate() -> None:
    share = split(100.0, 60, {"a": 100.0})["a"]
    assert 1 <= share.max_tokens <= share.rate  # at most a second's worth


def test_an_equal_share_is_what_an_even_split_gives_each() -> None:
    """What a bucket joining a shared rate gets at once, before the next split."""
    from sitsmesh.quota.split import equal_share

    for rate, window, envoys in ((10.0, 60, 5), (0.5, 3600, 3), (1000.0, 1, 7)):
        even = split(rate, window, dict.fromkeys(map(str, range(envoys))))
        share = equal_share(rate, window, envoys)
        assert share.fill_s == next(iter(even.values())).fill_s
        assert min(s.tokens_per_fill for s in even.values()) <= share.tokens_per_fill
        assert share.tokens_per_fill <= max(s.tokens_per_fill for s in even.values())


def _no_zero_by_scan(envoys: list[str], tokens: dict[str, int]) -> None:
    """The rule `_no_zero` keeps, written plainly: each Envoy with no token, in name
    order, takes one from the one with the most (the last name among equals)."""
    for e in envoys:
        if tokens[e] == 0:
            tokens[max(envoys, key=lambda o: (tokens[o], o))] -= 1
            tokens[e] = 1


@given(st.dictionaries(st.text(alphabet="abcxyz", min_size=1, max_size=3),
                       st.integers(0, 9), min_size=1, max_size=40),
       st.integers(0, 60))
def test_every_envoy_keeps_a_token_taken_as_a_plain_scan_would(
        given_tokens: dict[str, int], extra: int) -> None:
    envoys = sorted(given_tokens)
    tokens = dict(given_tokens)
    # split's tokens add up to at least one per Envoy.
    tokens[envoys[-1]] += max(0, len(envoys) - sum(tokens.values())) + extra
    expected = dict(tokens)
    _no_zero_by_scan(envoys, expected)
    _no_zero(envoys, tokens)
    assert tokens == expected and min(tokens.values()) >= 1


def test_a_thousand_envoys_on_a_small_rate_each_keep_a_token() -> None:
    """100 requests/s over 1 000 Envoys leaves hundreds without a token before the fix
    (a scan of all per zero took 16 ms of the event loop per split; the heap ~1 ms)."""
    demands = {f"envoy-{i:04d}": float(i % 7) for i in range(1000)}
    shares = split(100.0, 60, demands)
    fill = shares["envoy-0000"].fill_s
    assert sum(s.tokens_per_fill for s in shares.values()) == max(1000, round(100 * fill))
    assert min(s.tokens_per_fill for s in shares.values()) == 1
