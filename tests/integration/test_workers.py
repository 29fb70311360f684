"""--workers N: N processes share the data-plane port; a dead worker is replaced."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from sitsmesh.admin.enums import word
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

Start = Callable[..., harness.Sitsmesh]


def _status(node: harness.Sitsmesh) -> admin_pb2.GetStatusResponse:
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply: admin_pb2.GetStatusResponse = admin_pb2_grpc.AdminServiceStub(channel).GetStatus(
            admin_pb2.GetStatusRequest(), metadata=node.admin_metadata(), timeout=5)
        return reply


def test_two_workers_share_the_port_and_a_killed_one_is_replaced(start_sitsmesh: Start) -> None:
    node = start_sitsmesh("--workers", "2")
    harness.wait_until(lambda: all(w.alive for w in _status(node).workers)
                       and len(_status(node).workers) == 2, 20, "two live workers")
    workers = _status(node).workers
    pids = {w.pid for w in workers}
    assert len(pids) == 2
    assert node.proc.pid not in pids

    # Many fresh connections land on both workers (the kernel spreads them by hash).
    for _ in range(20):
        assert harness.health_status(node.data_addr) == 1

    victim = workers[0]
    os.kill(victim.pid, signal.SIGKILL)

    def replaced() -> bool:
        w = {x.index: x for x in _status(node).workers}[victim.index]
        return w.alive and w.pid != victim.pid and w.restarts == 1

    harness.wait_until(replaced, 20, "the killed worker to be restarted")
    assert harness.health_status(node.data_addr) == 1
    data = {(word(admin_pb2.Listener, s.server), s.name): s.state
            for s in _status(node).services}
    assert data[("data", "")] == admin_pb2.SERVING_STATE_SERVING
    assert '"worker exited; restarting"' in node.output()

    # Per-RPC metrics from every worker are aggregated by the supervisor's /metrics.
    harness.wait_until(
        lambda: harness.metric_value(node.metrics(), "grpc_server_handled_total",
                                     grpc_method="Check") >= 20,
        5, "worker metrics aggregated")
    assert node.stop() == 0


PIPELINE = "name: twostage\nstages:\n  - {name: pre, match: {upstream_cluster: pre}}\n"


def test_workers_refuse_what_needs_one_process_instead_of_answering_wrong(
        start_sitsmesh: Start, tmp_path: Path) -> None:
    """Pipelines and tenant concurrency caps count a request from its Check to its
    access-log entry, which can reach different workers: refused by name."""
    node = start_sitsmesh("--workers", "2")
    with grpc.insecure_channel(node.admin_addr) as channel:
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        meta = node.admin_metadata()
        with pytest.raises(grpc.RpcError) as err:
            admin.ApplyPipeline(admin_pb2.ApplyPipelineRequest(yaml=PIPELINE), metadata=meta,
                                timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "pipeline twostage: backpressure and latency chains needs --workers 1" in (
            err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            admin.CreateTenant(admin_pb2.CreateTenantRequest(
                tenant=admin_pb2.Tenant(name="capped", max_concurrency=5)),
                metadata=meta, timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tenant capped: max_concurrency needs --workers 1" in (err.value.details() or "")
        # Nothing was written; a tenant without a cap is fine.
        assert not admin.ListPipelines(admin_pb2.ListPipelinesRequest(), metadata=meta,
                                       timeout=5).pipelines
        admin.CreateTenant(admin_pb2.CreateTenantRequest(
            tenant=admin_pb2.Tenant(name="plain", models=["*"])), metadata=meta, timeout=5)
    node.stop()

    # State written by one process is refused at the start of several.
    single = start_sitsmesh(name="single")
    with grpc.insecure_channel(single.admin_addr) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).ApplyPipeline(
            admin_pb2.ApplyPipelineRequest(yaml=PIPELINE), metadata=single.admin_metadata(),
            timeout=5)
    single.stop()
    result = _serve_two_workers(single.state_dir)
    assert result.returncode == 2
    assert "--workers 2: the state holds pipelines twostage, which needs --workers 1" in (
        result.stderr)


def _serve_two_workers(state_dir: Path) -> subprocess.CompletedProcess[str]:
    """`serve --workers 2` on a state directory one process wrote: it must refuse."""
    return harness.run_cli("serve", "--workers", "2", "--state-dir", str(state_dir),
                           "--data-addr", f"127.0.0.1:{harness.free_port()}",
                           "--admin-addr", f"127.0.0.1:{harness.free_port()}",
                           "--metrics-addr", f"127.0.0.1:{harness.free_port()}")


BUDGET = ("apiVersion: sitsmesh.io/v1alpha1\nkind: TokenBudget\nmetadata: {name: acme}\n"
          "spec:\n  limits:\n    - {tokens: 1000, per: minute}\n")


def test_workers_on_the_memory_store_refuse_token_budgets(start_sitsmesh: Start,
                                                          tmp_path: Path) -> None:
    """A token budget in memory would be spent per worker, and a stream's end can reach
    another worker than its reservation: refused by name, at apply and at start."""
    (tmp_path / "budget.yaml").write_text(BUDGET)
    node = start_sitsmesh("--workers", "2")
    applied = node.cli("apply", "-f", str(tmp_path / "budget.yaml"))
    assert applied.returncode == 1
    assert "token budget acme: with --workers N and the memory counter store" in (
        applied.stderr)
    assert "tokenbudget" not in node.cli("get", "tokenbudgets").stdout.lower()
    node.stop()

    single = start_sitsmesh(name="single")
    assert single.cli("apply", "-f", str(tmp_path / "budget.yaml")).returncode == 0
    single.stop()
    result = _serve_two_workers(single.state_dir)
    assert result.returncode == 2
    assert "--workers 2: the state holds token budgets of acme, which need " \
           "--ratelimit-store redis" in result.stderr
