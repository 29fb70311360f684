"""The RLQS process's pure parts: the decision frames between the two processes, the
metrics registry that keeps live collectors in multiprocess mode, the rlqs_addr value
and the Envoy config that points the quota filter at it."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from sitsmesh.app.metrics import LiveCollectors
from sitsmesh.app.quotaproc import MAX_FRAME, frame, read_frames
from sitsmesh.config import load_settings
from sitsmesh.dev import envoyconf
from sitsmesh.errors import ConfigError
from sitsmesh.netsettings import Address, optional_address
from sitsmesh.pressure.controller import Decision, Snapshot

REPO = Path(__file__).resolve().parents[2]


def _decision(pipeline: str) -> Decision:
    return Decision(pipeline=pipeline, policy="shed", fraction=0.4, cutoff=1.6,
                    concurrency=3, protected_from=9, retry_after_s=1, bottleneck="svc",
                    level="overloaded", arrival_rate=80.0, stages=(), at=12.5,
                    priority_rates=(60.0, 20.0))


async def _read(data: bytes) -> list[Snapshot]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return [s async for s in read_frames(reader)]


def test_snapshots_cross_whole_and_in_order() -> None:
    sent = [Snapshot({"a": _decision("a")}, at=1.0), Snapshot({}, at=2.0)]
    assert asyncio.run(_read(b"".join(frame(s) for s in sent))) == sent


def test_a_frame_cut_short_ends_the_stream_without_a_half_snapshot() -> None:
    whole = frame(Snapshot({"a": _decision("a")}, at=1.0))
    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(_read(whole + whole[:-3]))


def test_an_oversized_or_foreign_frame_is_refused() -> None:
    with pytest.raises(ValueError, match="decision frame of"):
        asyncio.run(_read(struct.pack("!I", MAX_FRAME + 1)))
    body = b"\x80\x05N."  # pickle of None
    with pytest.raises(ValueError, match="holds a NoneType"):
        asyncio.run(_read(struct.pack("!I", len(body)) + body))


class _Live:
    def collect(self) -> list[Metric]:
        return [GaugeMetricFamily("live_value", "read at scrape time", value=7)]


def test_live_collectors_pass_on_only_what_is_read_at_scrape_time() -> None:
    served = CollectorRegistry()
    live = LiveCollectors(served)
    Counter("from_files", "multiprocess files carry it", registry=live).inc()
    live.register(_Live())
    names = {family.name for family in served.collect()}
    assert names == {"live_value"}


def test_rlqs_addr_values() -> None:
    assert optional_address("") is None
    assert optional_address("127.0.0.1:50053") == Address("127.0.0.1", 50053)
    assert optional_address("unix:/run/sitsmesh/rlqs.sock") == Address(
        "unix:/run/sitsmesh/rlqs.sock", 0)
    with pytest.raises(ValueError, match="expected a fixed port"):
        optional_address("127.0.0.1:0")
    with pytest.raises(ConfigError, match="is another server's"):
        load_settings(flags={"rlqs_addr": "127.0.0.1:9464"}, env={})


def test_envoy_streams_quotas_to_the_rlqs_addr() -> None:
    values = envoyconf.local_values(sitsmesh_addr="127.0.0.1:50051", upstream_port=8000,
                                    listen_port=10000, envoy_admin_port=9901)
    bootstrap = envoyconf.render(REPO / "filters" / "local" / "bootstrap.yaml", values,
                                 ["rate_limit_quota"])
    envoyconf.use_rlqs_addr(bootstrap, "127.0.0.1:50053")
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    rlqs = clusters["sitsmesh_rlqs"]
    [[endpoint]] = [e["lb_endpoints"] for e in rlqs["load_assignment"]["endpoints"]]
    assert endpoint["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1", "port_value": 50053}
    assert rlqs["health_checks"] == clusters["sitsmesh_data"]["health_checks"]
    [quota] = [f for f in envoyconf.http_connection_manager(bootstrap)["http_filters"]
               if f["name"] == "envoy.filters.http.rate_limit_quota"]
    assert quota["typed_config"]["rlqs_server"] == {
        "envoy_grpc": {"cluster_name": "sitsmesh_rlqs"}}
    with pytest.raises(ConfigError, match="no rate_limit_quota filter"):
        envoyconf.use_rlqs_addr(envoyconf.render(
            REPO / "filters" / "local" / "bootstrap.yaml", values, []), "127.0.0.1:50053")
