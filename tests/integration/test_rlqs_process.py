"""RLQS from a process of its own (rlqs_addr), with a real Envoy streaming to it: quotas
from configs applied through the admin API after the start (the process follows the
state store), a crash of the RLQS process (restarted; Check never notices), the data
process gone (the RLQS process stops with it), and bad settings refused at start.
The controller's decisions reaching it are tested in test_pressure_plain.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from grpc_health.v1 import health_pb2

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from tests.integration.test_rlqs_envoy import Pacer, Start

pytestmark = pytest.mark.integration
RLQS = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService"


def _config(free_per_minute: int) -> str:
    return ("domain: sitsmesh-local\ndescriptors:\n  - key: tenant\n    value: free\n"
            f"    rate_limit: {{unit: minute, requests_per_unit: {free_per_minute}}}\n")


def _apply(node: harness.Sitsmesh, free_per_minute: int) -> None:
    with grpc.insecure_channel(node.admin_addr) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).ApplyRateLimitConfig(
            admin_pb2.ApplyRateLimitConfigRequest(files=[admin_pb2.RateLimitConfigFile(
                name="free.yaml", yaml=_config(free_per_minute))]),
            metadata=node.admin_metadata(), timeout=5)


def _events(node: harness.Sitsmesh, event: str) -> list[dict[str, object]]:
    found = []
    for line in node.output().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def _rlqs_pid(node: harness.Sitsmesh, nth: int) -> int:
    harness.wait_until(lambda: len(_events(node, "rlqs started")) >= nth, 20,
                       f"RLQS process start {nth}")
    return int(str(_events(node, "rlqs started")[nth - 1]["pid"]))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): it has exited, its parent not reaped it yet.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def test_the_rlqs_process_follows_applied_configs_and_comes_back_after_a_crash(
        tmp_path: Path, start_sitsmesh: Start, upstream: int,
        kill_envoys: list[harness.Envoy]) -> None:
    rlqs_addr = f"127.0.0.1:{harness.free_port()}"
    node = start_sitsmesh("--rlqs-addr", rlqs_addr, name="rlqs-process")
    serving = health_pb2.HealthCheckResponse.SERVING
    assert harness.health_status(rlqs_addr, RLQS) == serving
    # Not on the data port too: two processes would each split the same global rate.
    # An Envoy still streaming there is told where to go, not failed open in silence.
    assert harness.health_status(node.data_addr, RLQS) is None
    with grpc.insecure_channel(node.data_addr) as channel, \
            pytest.raises(grpc.RpcError) as misdirected:
        next(rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel).StreamRateLimitQuotas(
            iter([rlqs_pb2.RateLimitQuotaUsageReports(domain="sitsmesh-local")]), timeout=5))
    assert misdirected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"RLQS is served on rlqs_addr {rlqs_addr}" in str(misdirected.value.details())
    assert _events(node, "an Envoy streams RLQS to the data port")
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                fragments=["rate_limit_quota"], rlqs_addr=rlqs_addr)
    kill_envoys.append(envoy)

    def status() -> int:
        return Pacer(envoy, "free", 1.0, 0)._send()

    status()  # Envoy opens its stream with this bucket's first report
    _apply(node, 0)  # after the start: the RLQS process reads it from the state store
    harness.wait_until(lambda: status() == 429, 15, "DENY_ALL from an applied config")
    first = _rlqs_pid(node, 1)
    harness.wait_until(lambda: harness.metric_value(node.metrics(), "sitsmesh_rlqs_streams")
                       == 1, 5, "the RLQS process's stream count on the data process's /metrics")

    def up() -> float:
        return harness.metric_value(node.metrics(), "sitsmesh_serving", server="rlqs",
                                    service=RLQS)

    assert up() == 1
    os.kill(first, signal.SIGKILL)
    harness.wait_until(lambda: up() == 0, 5, "sitsmesh_serving 0 while it restarts")
    second = _rlqs_pid(node, 2)
    assert second != first
    assert _events(node, "rlqs exited; restarting")
    # The data process never stopped serving.
    assert harness.health_status(node.data_addr) == serving
    harness.wait_until(lambda: harness.health_status(rlqs_addr, RLQS) == serving, 15,
                       "the restarted RLQS process serving")
    assert up() == 1
    _apply(node, 60_000)
    harness.wait_until(lambda: status() == 200, 20, "the new process's quota for free")
    _apply(node, 0)
    harness.wait_until(lambda: status() == 429, 20, "DENY_ALL again")

    # The data process gone (kill -9, OOM): the RLQS process stops too, not orphaned
    # serving quotas from decisions no one updates.
    os.kill(node.proc.pid, signal.SIGKILL)
    harness.wait_until(lambda: not _alive(second), 10, "the RLQS process to stop")


def test_bad_rlqs_addr_settings_stop_the_start(tmp_path: Path) -> None:
    data = f"127.0.0.1:{harness.free_port()}"
    common = ("serve", "--state-dir", str(tmp_path / "s"), "--data-addr", data,
              "--admin-addr", f"127.0.0.1:{harness.free_port()}",
              "--metrics-addr", f"127.0.0.1:{harness.free_port()}")
    same = harness.run_cli(*common, "--rlqs-addr", data)
    assert same.returncode == 2, same.stderr
    assert f"rlqs_addr: {data} is another server's" in same.stderr
    zero = harness.run_cli(*common, "--rlqs-addr", "127.0.0.1:0")
    assert zero.returncode == 2, zero.stderr
    assert "--rlqs-addr: expected a fixed port" in zero.stderr

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        busy = harness.run_cli(*common, "--rlqs-addr", f"127.0.0.1:{port}", timeout=60)
    assert busy.returncode == 2, busy.stderr
    assert f"rlqs_addr 127.0.0.1:{port}: the RLQS process did not start" in busy.stderr
    assert time.monotonic() - began < 30  # it gave up when the process died, not later


def test_workers_serve_rlqs_through_the_rlqs_process(
        tmp_path: Path, start_sitsmesh: Start, upstream: int,
        kill_envoys: list[harness.Envoy]) -> None:
    """Workers alone cannot serve RLQS (each would split the rates on its own); the one
    RLQS process beside them can."""
    rlqs_addr = f"127.0.0.1:{harness.free_port()}"
    data = f"127.0.0.1:{harness.free_port()}"
    config = tmp_path / "free.yaml"
    config.write_text(_config(0))
    node = start_sitsmesh("--workers", "2", "--rlqs-addr", rlqs_addr, "--ratelimit-config",
                          str(config), name="rlqs-workers",
                          addrs=(data, f"127.0.0.1:{harness.free_port()}",
                                 f"127.0.0.1:{harness.free_port()}"))
    assert "RLQS is not served by worker processes" not in node.output()
    envoy = harness.start_envoy(tmp_path, node.data_addr, upstream,
                                fragments=["rate_limit_quota"], rlqs_addr=rlqs_addr)
    kill_envoys.append(envoy)
    harness.wait_until(lambda: Pacer(envoy, "free", 1.0, 0)._send() == 429, 15,
                       "DENY_ALL from the RLQS process beside two workers")
