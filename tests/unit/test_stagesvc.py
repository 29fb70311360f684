"""The fixed-capacity stage service (sitsmesh.dev.stagesvc) on real loopback sockets."""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.stagesvc import DISTRIBUTIONS, Hop, ServiceTime, StageService, stage_service


def _get(port: int, path: str = "/", headers: dict[str, str] | None = None,
         conn: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        if own:
            conn.close()


def _burst(port: int, count: int, headers: dict[str, str] | None = None
           ) -> tuple[list[int], float]:
    """`count` requests at once, one connection each: their statuses and the wall time."""
    gate = threading.Barrier(count + 1)

    def one(_: int) -> int:
        gate.wait(5)
        return _get(port, headers=headers)[0]

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
        gate.wait(5)
        began = time.monotonic()
        statuses = [f.result(10) for f in futures]
        return statuses, time.monotonic() - began


def test_one_worker_serves_one_request_at_a_time_and_queues_the_rest() -> None:
    with stage_service(parallelism=1, service_ms=20) as svc:
        statuses, seconds = _burst(svc.port, 10)
        stats = svc.stats()
    assert statuses == [200] * 10
    assert seconds >= 0.2  # 10 x 20 ms, one at a time
    assert stats.served == stats.answered == 10
    assert stats.busy_max == 1
    assert stats.in_flight_max > 1  # the others waited in the stage's own queue
    assert stats.in_flight == 0


def test_parallelism_bounds_the_workers_busy_at_once() -> None:
    with stage_service(parallelism=3, service_ms=20) as svc:
        statuses, seconds = _burst(svc.port, 12)
        stats = svc.stats()
        assert svc.capacity_rps == pytest.approx(150)
    assert statuses == [200] * 12
    assert stats.busy_max == 3
    assert seconds >= 0.08  # 12 / 3 rounds of 20 ms


def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    with stage_service(parallelism=1, service_ms=0, name="pre") as svc:
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=5)
        try:
            replies = [_get(svc.port, conn=conn) for _ in range(3)]
        finally:
            conn.close()
    assert replies == [(200, b"pre ok\n")] * 3


def test_service_times_are_seeded_and_fixed_by_default() -> None:
    assert {ServiceTime(20).next() for _ in range(5)} == {0.02}
    a = [ServiceTime(20, "exp", seed=7).next() for _ in range(3)]
    b = ServiceTime(20, "exp", seed=7)
    assert [b.next() for _ in range(3)] != a  # one generator, not reseeded per draw
    c, d = ServiceTime(20, "exp", seed=7), ServiceTime(20, "exp", seed=7)
    assert [c.next() for _ in range(100)] == [d.next() for _ in range(100)]
    assert ServiceTime(0, "lognormal").next() == 0.0
    with pytest.raises(ValueError, match="distribution"):
        ServiceTime(20, "normal")


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_each_distribution_has_the_stage_s_mean(distribution: str) -> None:
    times = ServiceTime(20, distribution, seed=3)
    draws = [times.next() for _ in range(20000)]
    assert statistics.fmean(draws) == pytest.approx(0.02, rel=0.08)
    if distribution != "fixed":
        assert len(set(draws)) > 1


def test_fan_out_calls_the_next_hop_n_times_and_propagates_ids() -> None:
    with stage_service(name="model", parallelism=4, service_ms=1) as model, \
            stage_service(name="feat", parallelism=1, service_ms=1, forward_to=[model.url],
                          fanout=3) as feat:
        headers = {"x-request-id": "rid-1", "x-sits-tenant": "acme", "x-api-key": "secret"}
        statuses = [_get(feat.port, "/infer", headers)[0] for _ in range(4)]
        assert statuses == [200] * 4
        assert model.stats().served == 12
        assert feat.stats().calls == 12
        seen = list(model.recent_headers)
    assert len(seen) == 12
    for got in seen:
        assert got["x-request-id"] == "rid-1"
        assert got["x-sits-tenant"] == "acme"
        assert "x-api-key" not in got  # only the request id and x-sits-* go on


def test_hops_are_called_in_order_each_with_its_own_fanout() -> None:
    with stage_service(name="model", service_ms=0) as model, \
            stage_service(name="post", service_ms=0) as post, \
            stage_service(name="pre", service_ms=0,
                          forward_to=[Hop(model.url, fanout=2), post.url]) as pre:
        assert _get(pre.port)[0] == 200
        assert (model.stats().served, post.stats().served) == (2, 1)


def test_a_failed_hop_answers_502_all_the_way_up() -> None:
    closed = f"http://127.0.0.1:{harness.free_port()}"
    with stage_service(name="svc", service_ms=0, forward_to=[closed]) as svc, \
            stage_service(name="pre", service_ms=0, forward_to=[svc.url], fanout=2) as pre:
        status, body = _get(pre.port)
        assert status == 502
        assert body.startswith(b"pre:")
        assert svc.stats().failed == 2
        assert pre.stats().failed == 1
        assert pre.stats().call_failures == 2


def test_forwarding_before_the_work_skips_the_work_when_the_hop_fails() -> None:
    closed = f"http://127.0.0.1:{harness.free_port()}"
    with stage_service(service_ms=0, forward_to=[closed], order="before") as svc:
        assert _get(svc.port)[0] == 502
        assert svc.stats().served == 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="parallelism"):
        StageService(parallelism=0)
    with pytest.raises(ValueError, match="forward_to"):
        StageService(forward_to=["https://example.invalid"])
    with pytest.raises(ValueError, match="fanout"):
        StageService(forward_to=["http://127.0.0.1:1"], fanout=0)
