"""The ext_proc servicer's pure parts: where a stream's clock starts, and the stage
attributes Envoy sends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sitsmesh.transport.extproc import ExternalProcessorServicer, _attribute
from sitsmesh.transport.streams import OpenStreams

WALL = datetime(2026, 12, 5, 6, 16, 15, 723213, tzinfo=UTC).timestamp()


def _request(**attributes: str) -> pb.ProcessingRequest:
    request = pb.ProcessingRequest()
    request.attributes["envoy.filters.http.ext_proc"].update(attributes)
    return request


@pytest.mark.parametrize(("raw", "started"), [
    ("2026-12-05T06:16:15.718213+00:00", 99.995),  # Envoy had it 5 ms before we did
    ("2026-12-05T06:16:17.723213+00:00", 100.0),   # in our future: skewed clocks
    ("2026-12-05T06:16:10.723213+00:00", 100.0),   # 5 s before: skewed clocks
    ("not a time", 100.0),
])
def test_the_clock_starts_when_envoy_had_the_request(raw: str, started: float) -> None:
    servicer = ExternalProcessorServicer(lambda report: None, OpenStreams(), stall_s=1.0,
                                         wall=lambda: WALL)
    assert servicer._started(_request(**{"request.time": raw}), 100.0) == \
        pytest.approx(started)
    assert servicer._started(pb.ProcessingRequest(), 100.0) == 100.0


def test_attributes_are_read_as_strings_and_bounded() -> None:
    request = _request(**{"xds.cluster_name": "llm", "xds.route_name": "r" * 1000})
    assert _attribute(request, "xds.cluster_name") == "llm"
    assert len(_attribute(request, "xds.route_name")) == 256
    assert _attribute(request, "absent") == ""
