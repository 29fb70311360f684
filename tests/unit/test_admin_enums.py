"""The admin API's enums as words: both ways, at any depth of a message, unknown numbers kept."""

from __future__ import annotations

import pytest
from google.protobuf.json_format import MessageToDict

from sitsmesh.admin.enums import label, word, words, words_in
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.pressure.stages import HIGH, OK, OVERLOADED, STALE
from sitsmesh.pressure.thresholds import POLICIES
from sitsmesh.swap.machine import PROGRESS
from sitsmesh.swap.record import FAILED, INTERRUPTED, ROLLED_BACK, RUNNING, SUCCEEDED


def test_words_round_trip_and_the_zero_is_the_empty_word() -> None:
    assert word(admin_pb2.PressureLevel, admin_pb2.PRESSURE_LEVEL_OVERLOADED) == "overloaded"
    assert word(admin_pb2.SwapState, admin_pb2.SWAP_STATE_ROLLED_BACK) == "rolled_back"
    assert word(admin_pb2.OverloadReason, 0) == ""
    assert label(admin_pb2.SignalSource, "envoy_stats") == "SIGNAL_SOURCE_ENVOY_STATS"
    assert label(admin_pb2.OverloadReason, "") == "OVERLOAD_REASON_UNSPECIFIED"
    # A number a newer server sends that this build does not know stays visible.
    assert word(admin_pb2.SwapPhase, 99) == "99"


def test_a_word_the_enum_does_not_have_names_the_ones_it_has() -> None:
    with pytest.raises(ValueError, match="'melted' is not one of ok, high, overloaded, stale"):
        label(admin_pb2.PressureLevel, "melted")


def test_every_word_the_domain_uses_has_an_enum_value() -> None:
    # The enums mirror closed sets defined elsewhere: a new word there must come here too.
    assert set(words(admin_pb2.PressureLevel)) == {OK, HIGH, OVERLOADED, STALE}
    assert set(words(admin_pb2.SwapPhase)) == set(PROGRESS)
    assert set(words(admin_pb2.SwapState)) == {RUNNING, SUCCEEDED, FAILED, ROLLED_BACK,
                                               INTERRUPTED}
    assert words(admin_pb2.PressurePolicy) == list(POLICIES)
    assert words(admin_pb2.WarmupData) == ["zero", "random"]


def test_words_in_spells_nested_and_repeated_enums_and_leaves_the_rest() -> None:
    message = admin_pb2.WatchPressureResponse(pipelines=[admin_pb2.PipelinePressure(
        pipeline="p", level=admin_pb2.PRESSURE_LEVEL_HIGH, stages=[admin_pb2.StagePressure(
            name="s", level=admin_pb2.PRESSURE_LEVEL_OVERLOADED,
            reason=admin_pb2.OVERLOAD_REASON_SURGE, signals=[admin_pb2.SignalAge(
                source=admin_pb2.SIGNAL_SOURCE_ACCESS_LOG, age_s=1.5)])])])
    message.at.FromSeconds(7)
    doc = words_in(message, MessageToDict(message, preserving_proto_field_name=True))
    pipeline = doc["pipelines"][0]
    assert (pipeline["level"], pipeline["stages"][0]["level"], pipeline["stages"][0]["reason"],
            pipeline["stages"][0]["signals"][0]["source"]) == (
        "high", "overloaded", "surge", "access_log")
    assert doc["at"] == "1970-01-01T00:00:07Z"
    status = admin_pb2.ServiceStatus(name="x", state=admin_pb2.SERVING_STATE_DRAINING)
    assert words_in(status, MessageToDict(status), upper=frozenset(
        {"sitsmesh.admin.v1.ServingState"}))["state"] == "DRAINING"
