"""Compiled model globs answer exactly what fnmatch.fnmatchcase over the lists answered,
including which group (pipeline) wins when several match, at a cost that does not grow
with the number of globs."""

from __future__ import annotations

import fnmatch
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sitsmesh import globs
from sitsmesh.globs import NONE, GlobError, Globs

# Few letters, so that names and globs collide often; every glob metacharacter, and
# characters a regex or a prefix split could get wrong.
_ALPHABET = "ab-.*?[]!\\^\n"
_NAME = st.text(alphabet="ab-.[]!\\^\n*?", max_size=8)
_GLOB = st.text(alphabet=_ALPHABET, max_size=7)
_GROUPS = st.lists(st.lists(_GLOB, max_size=5), max_size=5)


def _reference(groups: list[list[str]], name: str) -> int:
    """What PressureGate.pipeline_for and Tenant.allows did before: the first glob, in
    order, that fnmatchcase matches."""
    return next((i for i, group in enumerate(groups) for glob in group
                 if fnmatch.fnmatchcase(name, glob)), NONE)


@settings(max_examples=3000, deadline=None)
@given(_GROUPS, st.lists(_NAME, max_size=6))
def test_first_matches_fnmatchcase_in_order(groups: list[list[str]], names: list[str]) -> None:
    compiled = Globs(groups)
    # The globs themselves (with their metacharacters taken literally) are names too.
    for name in [*names, *(g for group in groups for g in group)]:
        expected = _reference(groups, name)
        assert compiled.first(name) == expected, (groups, name)
        assert compiled.matches(name) == (expected != NONE)
        assert compiled.groups(name) == [i for i, group in enumerate(groups) if any(
            fnmatch.fnmatchcase(name, glob) for glob in group)], (groups, name)


@pytest.mark.parametrize(("glob", "kind"), [
    ("bert", "exact"), ("bert*", "prefix"), ("*", "prefix"), ("b**", "prefix"),
    ("*-llm", "suffix"), ("**x", "suffix"), ("a*b", "general"), ("*a*", "general"),
    ("m?", "general"), ("m[12]", "general"), ("m[", "general"), ("[*", "general"),
])
def test_shapes(glob: str, kind: str) -> None:
    assert globs.shape(glob) == kind


def test_an_earlier_group_wins_across_shapes() -> None:
    compiled = Globs([["x"], ["team-a-*"], ["team-?-llm", "*-llm"], ["team-a-llm"]])
    assert compiled.first("team-a-llm") == 1
    assert compiled.groups("team-a-llm") == [1, 2, 3]
    assert compiled.groups("other") == []
    assert compiled.first("team-b-llm") == 2
    assert compiled.first("other") == NONE
    assert compiled.first("") == NONE
    assert Globs([["*"]]).first("") == 0
    assert not Globs([]) and not Globs([[]]) and Globs([["a"]])


def test_forty_thousand_globs_cost_what_a_few_do() -> None:
    """The issue: 40 000 globs made each unseen model cost 1.5 s (fnmatch recompiles
    past its 32 768-pattern cache). Generous bound: 2 000 unseen names in well under a
    second where fnmatch over the list takes minutes."""
    groups = [[f"team-b-model-{i}" for i in range(20_000)],
              [f"team-c-{i}-*" for i in range(19_744)],
              [f"team-d-{i}-v?" for i in range(256)],
              [f"glob-{i}-*-model" for i in range(40_000)]]
    compiled = Globs(groups)
    started = time.perf_counter()
    for i in range(2_000):
        assert compiled.first(f"unseen-{i}-" + "x" * 200) == NONE
    assert time.perf_counter() - started < 2.0
    assert compiled.first("team-c-7-anything") == 1
    assert compiled.first("team-d-255-v2") == 2
    assert compiled.first("glob-39999-x-model") == 3


def test_bounds_are_checked_with_precise_errors() -> None:
    globs.check([f"m{i}" for i in range(globs.MAX_GLOBS)], "pipeline p")
    # Distinct literal starts: a name is tried against a few of them, however many.
    globs.check([f"glob-{i}-*-model" for i in range(40_000)], "pipeline p")
    globs.check([f"m-?{i}" for i in range(globs.MAX_GENERAL_GLOBS)], "pipeline p")
    with pytest.raises(GlobError, match=r"^pipeline p: 50001 model globs; at most 50000$"):
        globs.check([f"m{i}" for i in range(globs.MAX_GLOBS + 1)], "pipeline p")
    with pytest.raises(GlobError) as refused:
        globs.check([f"m-?{i}" for i in range(globs.MAX_GENERAL_GLOBS + 1)], "tenant t")
    assert str(refused.value) == (
        "tenant t: 65 model globs with '?', '[...]' or a '*' between literals would all be "
        "tried for a model named 'm-'...: their text before the first wildcard is 'm-' or a "
        "start of it; at most 64 may share one (exact names, 'prefix*' and '*suffix' are "
        "not counted)")
    # Starts that are starts of each other add up: 'a' and 'ab' are both tried for 'abc'.
    with pytest.raises(GlobError, match=r"^tenant t: 65 model globs .* named 'ab'\.\.\."):
        globs.check([f"a?{i}" for i in range(40)] + [f"ab?{i}" for i in range(25)]
                    + [f"b?{i}" for i in range(60)], "tenant t")
    with pytest.raises(GlobError, match=r"is 1025 characters long; at most 1024$"):
        globs.check(["a" * 1025], "tenant t")


def test_widest_counts_the_chain_of_starts() -> None:
    assert globs._widest([]) == (0, "")
    assert globs._widest(["", "a", "ab", "abc", "b", "b", "b", "b"]) == (5, "b")
    assert globs._widest(["", "a", "ab", "abc", "b"]) == (4, "abc")
    assert globs._widest(["x", "xa", "xb", "xb"]) == (3, "xb")


class _Counting(Globs):
    __slots__ = ("calls",)

    def __init__(self, groups: list[list[str]]) -> None:
        super().__init__(groups)
        self.calls = 0

    def first(self, name: str) -> int:
        self.calls += 1
        return super().first(name)


def test_the_gate_picks_the_first_pipeline_and_keeps_models_in_use_cached() -> None:
    from sitsmesh.chains.pipeline import pipeline_from
    from sitsmesh.pressure import gate as gatemod
    from sitsmesh.pressure.signals import Signals

    groups = [["bert", "gpt-*"], ["*-llm", "gpt-?"], ["gpt-2"]]
    pipelines = {f"p{i}": pipeline_from(f"p{i}", {"models": models, "stages": [
        {"name": "s", "match": {"upstream_cluster": "c"}}]}) for i, models in enumerate(groups)}
    gate = gatemod.PressureGate(Signals())
    gate.set_pipelines(pipelines)
    for model in ("bert", "gpt-2", "gpt-x-llm", "a-llm", "gpt", "other", ""):
        expected = _reference(groups, model)
        assert gate.pipeline_for("", model) == (f"p{expected}" if expected != NONE else "")
    assert gate.pipeline_for("p2", "bert") == "p2"
    assert gate.pipeline_for("nonexistent", "bert") == "p0"

    counting = _Counting(groups)
    gate._globs = counting
    gate._routes, gate._old_routes = {}, {}
    # A stream of unseen names between every two requests for the model in use: that
    # model is matched once, not after every MAX_ROUTES unseen names as when the cache
    # was cleared whole.
    for i in range(5 * gatemod.MAX_ROUTES):
        gate.pipeline_for("", f"unseen-{i}")
        if i % 1000 == 0:
            assert gate.pipeline_for("", "a-llm") == "p1"
    assert counting.calls == 5 * gatemod.MAX_ROUTES + 1
    assert len(gate._routes) + len(gate._old_routes) <= 2 * gatemod.MAX_ROUTES
