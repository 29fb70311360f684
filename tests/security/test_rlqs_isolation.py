"""RLQS against a hostile neighbour, through a real `sitsmesh serve` (issue 26): a
stream that never reads is ended and its buckets freed; long bucket ids are bounded
per stream and across streams; other streams keep their answers meanwhile.

The server's RSS comes from /proc/<pid>/status; every attack stops as soon as it
crosses its bound, so a regression fails fast instead of eating the machine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from google.protobuf import duration_pb2

from sitsmesh.dev import harness
from tests.security.test_limits_memory import Budget, rss_mb

pytestmark = pytest.mark.integration

_Usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage


@pytest.fixture
def node(tmp_path: Path) -> Iterator[harness.Sitsmesh]:
    started = harness.start_sitsmesh(tmp_path)
    yield started
    started.kill()


def _report(ids: list[dict[str, str]], domain: str = "edge") -> rlqs_pb2.RateLimitQuotaUsageReports:
    return rlqs_pb2.RateLimitQuotaUsageReports(domain=domain, bucket_quota_usages=[
        _Usage(bucket_id=rlqs_pb2.BucketId(bucket=bid), num_requests_allowed=1,
               time_elapsed=duration_pb2.Duration(seconds=1)) for bid in ids])


def _metric(node: harness.Sitsmesh, name: str) -> float:
    return harness.metric_value(node.metrics(), name)


def _long_ids(tag: str, count: int) -> list[dict[str, str]]:
    return [{f"k{e:02}": f"{tag}-{i}-".ljust(250, "v") for e in range(16)}
            for i in range(count)]


def _reading_stream(channel: grpc.Channel, ids: list[dict[str, str]]) -> int:
    """Open a well-behaved stream: one report, read its reply; return how many buckets
    it got an answer for."""
    stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
    replies = stub.StreamRateLimitQuotas(iter([_report(ids)]), timeout=30)
    first = next(replies)
    replies.cancel()
    return len(first.bucket_action)


def test_a_stream_that_never_reads_is_ended_and_its_memory_freed(
        node: harness.Sitsmesh) -> None:
    """Issue 26: the README said such a stream is ended after 64 queued replies, but
    the writer sat in `context.write` for good (+371 MB for one stream)."""
    channel = grpc.insecure_channel(node.data_addr)
    stop = threading.Event()
    sent = [0]

    def reports() -> Iterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        # The same 300 buckets again and again: each report is answered in full.
        ids = _long_ids("stuck", 300)
        while not stop.is_set() and sent[0] < 2_000:
            sent[0] += 1
            yield _report(ids)

    stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
    call = stub.StreamRateLimitQuotas(reports(), timeout=120)  # never read
    budget = Budget(node)
    try:
        deadline = time.monotonic() + 90
        while _metric(node, "sitsmesh_rlqs_streams_not_reading_total") < 1:
            assert time.monotonic() < deadline, (
                f"the stream was not ended ({sent[0]} reports sent)")
            budget.check(f"after {sent[0]} reports")
            time.sleep(0.5)
        # Ended means gone: no stream, no bucket, no id bytes left on the server.
        harness.wait_until(lambda: _metric(node, "sitsmesh_rlqs_streams") == 0, 10,
                           "the stream to be forgotten")
        assert _metric(node, "sitsmesh_rlqs_bucket_id_bytes") == 0
        budget.check("after the stream ended")
        budget.report("a stream that never reads")
        # What the caller still sends is not taken up again (grpc discards it).
        time.sleep(2)
        assert _metric(node, "sitsmesh_rlqs_streams") == 0
        budget.check("2 s after the stream ended")
        # Another Envoy is still answered.
        assert _reading_stream(channel, [{"tenant": "acme"}]) == 1
    finally:
        stop.set()
        call.cancel()
        channel.close()


def test_long_bucket_ids_are_bounded_per_stream_and_in_all(node: harness.Sitsmesh) -> None:
    """Issue 26: ~25 MB per stream of 1 000 ids of 16 entries of 256 characters
    (past 512 MB at 17 streams). Now a stream keeps what its 2 MiB bound holds and the
    rest is abandoned, counted in sitsmesh_rlqs_buckets_refused_total."""
    channel = grpc.insecure_channel(node.data_addr)
    stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
    budget = Budget(node)
    calls = []
    done = threading.Event()

    def held_open(reports: list[rlqs_pb2.RateLimitQuotaUsageReports],
                  ) -> Iterator[rlqs_pb2.RateLimitQuotaUsageReports]:
        yield from reports
        done.wait(60)  # an Envoy keeps its stream open

    try:
        for s in range(20):
            # Five reports of 200 ids (each under the 4 MiB message bound), replies read.
            ids = _long_ids(f"s{s}", 1_000)
            call = stub.StreamRateLimitQuotas(held_open(
                [_report(ids[i:i + 200]) for i in range(0, 1_000, 200)]), timeout=60)
            kept = refused = 0
            for reply in call:
                for action in reply.bucket_action:
                    if action.HasField("abandon_action"):
                        refused += 1
                    else:
                        kept += 1
                if kept + refused >= 1_000:
                    break
            calls.append(call)  # held open: its buckets stay kept
            assert 0 < kept < 1_000 and kept + refused == 1_000, (kept, refused)
            budget.check(f"stream {s}")
        held = _metric(node, "sitsmesh_rlqs_bucket_id_bytes")
        assert 0 < held <= 20 * 2 * 1024 * 1024
        assert _metric(node, "sitsmesh_rlqs_buckets_refused_total") > 0
        budget.report(f"20 streams of long ids ({held / 2**20:.0f} MiB counted)")
        assert rss_mb(node) - budget.baseline < 150
        # A well-behaved Envoy still gets its bucket.
        assert _reading_stream(channel, [{"tenant": "acme"}]) == 1
    finally:
        done.set()
        for call in calls:
            call.cancel()
        channel.close()


def test_a_stream_that_half_closes_gets_every_reply_then_ends(
        node: harness.Sitsmesh) -> None:
    """The writer sends what the reader left (in replies of at most 200), then ends
    the stream OK, rather than wait for updates that will not come."""
    with grpc.insecure_channel(node.data_addr) as channel:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
        ids = [{"tenant": f"t{i}", "priority": "0"} for i in range(450)]
        call = stub.StreamRateLimitQuotas(iter([_report(ids)]), timeout=15)
        answered = sum(len(reply.bucket_action) for reply in call)  # ends, or times out
        assert call.code() == grpc.StatusCode.OK
        assert answered == 450
