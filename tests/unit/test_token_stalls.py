"""Per-stage stall thresholds: a stage's `stall_ms` (validated like every pipeline
field), else the threshold learned from the stage's own inter-token latency, and the
ext_proc servicer asking for it when a stream's response headers name its stage."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sitsmesh.chains.pipeline import InvalidPipeline, pipeline_from
from sitsmesh.declarative.models import PipelineSpec
from sitsmesh.tokens.stages import StageIndex
from sitsmesh.tokens.stalls import (
    CEILING_S,
    DEFAULT_S,
    FLOOR_S,
    MIN_STREAMS,
    RECENT,
    StallThresholds,
    learned_stall_s,
)
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End, StreamSummary
from sitsmesh.transport.extproc import ExternalProcessorServicer
from sitsmesh.transport.streams import OpenStreams
from tests.observed import TOKEN, sse_exchange


def _pipelines(**stall_ms: object) -> dict[str, Any]:
    """Pipeline `chat`: stages guard (cluster guard) and llm (route llm), with stall_ms
    where given."""
    stages = [{"name": name, "match": {key: name}, **(
        {"stall_ms": stall_ms[name]} if name in stall_ms else {})}
        for name, key in (("guard", "upstream_cluster"), ("llm", "route_name"))]
    return {"chat": pipeline_from("chat", {"stages": stages}, "chat.yaml")}


def _summary(itl_p99_s: float | None) -> StreamSummary:
    return StreamSummary(0.1, itl_p99_s, itl_p99_s, 10, 10.0, (), 0, End.COMPLETE)


def _thresholds(**stall_ms: object) -> tuple[StageIndex, StallThresholds]:
    stages = StageIndex()
    stages.set_pipelines(_pipelines(**stall_ms))
    return stages, StallThresholds(stages)


# --- configured --------------------------------------------------------------------------

def test_a_configured_stall_ms_is_the_stages_threshold() -> None:
    _, stalls = _thresholds(llm=300)
    assert stalls.stall_of("other-cluster", "llm") == 0.3
    assert stalls.stall_of("guard", "") == DEFAULT_S        # guard left it to be learned
    assert stalls.stall_of("nobody", "nothing") == DEFAULT_S  # a stream of no stage


def test_a_configured_stage_learns_nothing() -> None:
    _, stalls = _thresholds(llm=300)
    for _ in range(MIN_STREAMS):
        stalls.learn("chat", "llm", _summary(0.5))
    assert stalls.stall_of("", "llm") == 0.3


def test_stall_ms_round_trips_through_the_pipeline_body() -> None:
    [llm] = [s for s in _pipelines(llm=250.5)["chat"].stages if s.name == "llm"]
    assert llm.stall_ms == 250.5
    again = pipeline_from("chat", _pipelines(llm=250.5)["chat"].to_body())
    assert again == _pipelines(llm=250.5)["chat"]


@pytest.mark.parametrize("value", [0, 9.99, 60_001, -5, "300", True, [300]])
def test_a_bad_stall_ms_is_refused_by_name(value: object) -> None:
    with pytest.raises(InvalidPipeline) as refused:
        _pipelines(llm=value)
    assert str(refused.value) == ("chat.yaml: stages[1].stall_ms must be a number of "
                                  "milliseconds from 10 to 60000")


def test_a_refused_pipeline_changes_no_threshold() -> None:
    stages, stalls = _thresholds(llm=300)
    with pytest.raises(InvalidPipeline):
        stages.set_pipelines(_pipelines(llm=0))
    assert stalls.stall_of("", "llm") == 0.3


@pytest.mark.parametrize(("value", "ok"), [(10, True), (60_000, True), (9, False),
                                           (60_001, False)])
def test_the_declarative_schema_has_the_same_bounds(value: int, ok: bool) -> None:
    spec = {"stages": [{"name": "llm", "match": {"route_name": "llm"}, "stall_ms": value}]}
    if ok:
        assert PipelineSpec.model_validate(spec).stages[0].stall_ms == value
    else:
        with pytest.raises(ValueError, match="stall_ms"):
            PipelineSpec.model_validate(spec)


def test_a_reload_swaps_the_configured_thresholds() -> None:
    stages, stalls = _thresholds(llm=300)
    stages.set_pipelines(_pipelines(llm=2000))
    assert stalls.stall_of("", "llm") == 2.0
    stages.set_pipelines(_pipelines())
    assert stalls.stall_of("", "llm") == DEFAULT_S


# --- learned ----------------------------------------------------------------------------

def test_the_rule_is_a_multiple_of_the_median_itl_p99_within_floor_and_ceiling() -> None:
    assert learned_stall_s([0.1] * 20) == pytest.approx(0.4)
    assert learned_stall_s([0.01] * 20) == FLOOR_S           # fast engine: the floor
    assert learned_stall_s([3.0] * 20) == CEILING_S          # slow engine: the ceiling
    # A few stalled streams (their p99 is the stall) do not move the median.
    assert learned_stall_s([0.1] * 15 + [2.0] * 5) == pytest.approx(0.4)


def test_one_second_until_enough_streams_then_learned() -> None:
    _, stalls = _thresholds()
    for _ in range(MIN_STREAMS - 1):
        stalls.learn("chat", "guard", _summary(0.1))
    assert stalls.stall_of("guard", "") == DEFAULT_S
    stalls.learn("chat", "guard", _summary(0.1))
    assert stalls.stall_of("guard", "") == pytest.approx(0.4)
    assert stalls.stall_of("", "llm") == DEFAULT_S  # per stage: llm saw nothing


def test_streams_without_a_gap_teach_nothing() -> None:
    _, stalls = _thresholds()
    for _ in range(2 * MIN_STREAMS):
        stalls.learn("chat", "guard", _summary(None))
    assert stalls.stall_of("guard", "") == DEFAULT_S


def test_the_recent_streams_follow_the_engine() -> None:
    _, stalls = _thresholds()
    for _ in range(RECENT):
        stalls.learn("chat", "guard", _summary(0.1))
    for _ in range(RECENT // 2 + 1):  # a slower engine swapped in
        stalls.learn("chat", "guard", _summary(0.3))
    assert stalls.stall_of("guard", "") == pytest.approx(1.2)


def test_unknown_and_removed_stages_are_not_kept() -> None:
    stages, stalls = _thresholds()
    for _ in range(MIN_STREAMS):
        stalls.learn("chat", "guard", _summary(0.1))
        stalls.learn("chat", "nope", _summary(0.1))
    assert stalls._recent.keys() == {("chat", "guard")}
    stages.set_pipelines({})
    stalls.learn("chat", "guard", _summary(0.1))
    assert not stalls._recent and not stalls._learned


# --- the servicer asks when the response headers name the stage ---------------------------



def _serve_one(stall_of: Any, gap_s: float) -> tuple[TokenReport, list[tuple[str, str]]]:
    """Two tokens `gap_s` apart, the response headers naming cluster guard, route r."""
    now = [100.0]
    asked: list[tuple[str, str]] = []
    reports: list[TokenReport] = []

    def ask(cluster: str, route: str) -> float:
        asked.append((cluster, route))
        return float(stall_of(cluster, route))

    servicer = ExternalProcessorServicer(reports.append, OpenStreams(), stall_s=DEFAULT_S,
                                         clock=lambda: now[0],
                                         stall_of=ask if stall_of is not None else None)

    def set_now(at: float) -> None:
        now[0] = at

    messages = sse_exchange([(100.1, TOKEN, False), (100.1 + gap_s, TOKEN, True)], set_now,
                            {"xds.cluster_name": "guard", "xds.route_name": "r"})
    asyncio.run(servicer._serve(messages.__anext__, None))  # type: ignore[arg-type]
    [report] = reports
    return report, asked


def test_the_servicer_uses_the_stages_threshold() -> None:
    _, stalls = _thresholds(guard=300)
    report, asked = _serve_one(stalls.stall_of, 0.5)
    assert asked == [("guard", "r")]
    assert report.summary.stall_count == 1
    [stall] = report.summary.stalls
    assert stall.length_s == pytest.approx(0.5)


def test_without_a_callback_stall_s_holds_for_every_stream() -> None:
    report, asked = _serve_one(None, 0.5)
    assert asked == [] and report.summary.stall_count == 0
