"""Graceful shutdown: SIGTERM while health and admin RPCs stream in; none may fail."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]
SERVING = health_pb2.HealthCheckResponse.SERVING


def _active_calls(envoy: harness.Envoy) -> int:
    name = "cluster.sitsmesh_data.upstream_rq_active"
    for line in envoy.admin_get(f"/stats?filter=^{name}$").splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return 0


async def _hammer(node: harness.Sitsmesh, sigterm_after: float,
                  concurrency: int = 8) -> tuple[int, list[str], bool]:
    """Send health and admin RPCs until health says NOT_SERVING, as a load balancer would.

    Returns (completed RPCs, failures, saw NOT_SERVING).
    """
    meta = node.admin_metadata()
    failures: list[str] = []
    done = 0
    draining = asyncio.Event()
    deadline = time.monotonic() + 30  # bounded whatever happens
    async with aio.insecure_channel(node.data_addr) as data, \
            aio.insecure_channel(node.admin_addr) as admin:
        health = health_pb2_grpc.HealthStub(data)
        admin_stub = admin_pb2_grpc.AdminServiceStub(admin)

        async def worker(i: int) -> None:
            nonlocal done
            while not draining.is_set() and time.monotonic() < deadline:
                try:
                    if i % 2:
                        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                        if reply.status != SERVING:
                            draining.set()
                    else:
                        await admin_stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=meta,
                                                   timeout=5)
                    done += 1
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code()}: {exc.details()}")

        async def terminate() -> None:
            await asyncio.sleep(sigterm_after)
            node.proc.send_signal(signal.SIGTERM)

        await asyncio.gather(terminate(), *(worker(i) for i in range(concurrency)))
    return done, failures, draining.is_set()


async def test_sigterm_during_rpc_stream_fails_none_and_exits_zero(start_sitsmesh: Start) -> None:
    node = start_sitsmesh(drain=1.0)
    done, failures, saw_draining = await _hammer(node, sigterm_after=0.5)
    assert failures == []
    assert saw_draining, "health must go NOT_SERVING before the listener closes"
    assert done > 50
    code = await asyncio.get_running_loop().run_in_executor(None, node.proc.wait, 30)
    assert code == 0, node.output()
    log = node.output()
    assert log.index('"draining"') < log.index('"stopped"')


async def test_sigterm_with_workers_drains_every_worker(start_sitsmesh: Start) -> None:
    node = start_sitsmesh("--workers", "2", drain=1.0)
    done, failures, saw_draining = await _hammer(node, sigterm_after=0.5)
    assert failures == []
    assert saw_draining
    assert done > 50
    code = await asyncio.get_running_loop().run_in_executor(None, node.proc.wait, 30)
    assert code == 0, node.output()
    assert node.output().count('"worker stopped"') == 2


def test_envoys_open_streams_end_at_the_drain_so_sigterm_does_not_wait_out_the_grace(
        tmp_path: Path, start_sitsmesh: Start, upstream: int) -> None:
    """Envoy never closes its access-log and stats streams; a replica used to wait its
    whole grace for them on every shutdown (and then cut them off)."""
    grace, drain = 20.0, 0.5
    node = start_sitsmesh("--grace-seconds", str(grace), drain=drain)
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                fragments=["access_log", "metrics_service"])
    try:
        for _ in range(5):
            with urllib.request.urlopen(envoy.url("/v2/models/bert/infer"), timeout=5) as r:
                assert r.status == 200
        harness.wait_until(lambda: _active_calls(envoy) >= 2, 10,
                           "Envoy's access-log and stats streams to open")
        began = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(grace + 10) == 0, node.output()
        took = time.monotonic() - began
    finally:
        envoy.kill()
    assert took < drain + 3, f"shutdown took {took:.1f} s: it waited for the grace"
    ended = [json.loads(line) for line in node.output().splitlines()
             if '"ended Envoy streams"' in line]
    assert ended and ended[0]["streams"] >= 2, node.output()[-3000:]
