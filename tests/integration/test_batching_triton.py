"""Dynamic batching through `sitsmesh serve` against real Triton: profile on the preflight
sandbox, tune from the curve and the SLA, apply as a warm config swap under load.

The model (sitsmesh.dev.batch_model) costs 20 ms per execute plus 0.5 ms per item up to
16 items, time growing with the items past them: one at a time it serves ~48 items/s,
in batches of 16 about 570. The knee is at 16.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as triton_grpc

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.dev.batch_model import write_batch_model
from sitsmesh.dev.triton import TritonServer
from sitsmesh.dev.tritonload import OpenLoop

pytestmark = pytest.mark.integration

MODEL = "bm"
SLA_MS = 100.0
RATE = 150.0        # items/s: three times what the model serves one at a time
PIPELINE = """\
name: infer
stages:
  - name: model
    match: {upstream_cluster: triton}
    sla_p99_ms: 100
    triton_model: bm
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer,
                                                                       harness.Sitsmesh]]:
    tmp = tmp_path_factory.mktemp("batching")
    repo = tmp / "models"
    write_batch_model(repo, MODEL)
    prod, sandbox = TritonServer(tmp / "prod", repo), TritonServer(tmp / "sandbox", repo)
    prod.start()
    sandbox.start()
    node = None
    try:
        client = triton_grpc.InferenceServerClient(prod.grpc_url)
        client.load_model(MODEL)
        client.close()
        node = harness.start_sitsmesh(tmp, "--triton-url", prod.grpc_url,
                                      "--triton-metrics-url", prod.metrics_url,
                                      "--triton-preflight-url", sandbox.grpc_url)
        pipeline = tmp / "pipeline.yaml"
        pipeline.write_text(PIPELINE)
        applied = node.cli("pipelines", "apply", str(pipeline))
        assert applied.returncode == 0, applied.stderr
        yield prod, node
    finally:
        if node is not None:
            node.kill()
        prod.kill()
        sandbox.kill()


def _json(result: Any) -> Any:
    assert result.returncode == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def _batching_in_force(triton: TritonServer) -> Any:
    client = triton_grpc.InferenceServerClient(triton.grpc_url)
    try:
        return client.get_model_config(MODEL, as_json=True)["config"].get("dynamic_batching")
    finally:
        client.close()


@pytest.fixture(scope="module")
def profiled(stack: tuple[TritonServer, harness.Sitsmesh],
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The sandbox profile every test here tunes from, and its plot."""
    _, node = stack
    plot = tmp_path_factory.mktemp("plot") / "curve.png"
    curve = _json(node.cli("models", "profile", MODEL, "--requests", "12", "--plot", str(plot),
                           "-o", "json", timeout=300))
    return curve, plot


def test_profile_on_the_sandbox_finds_the_knee_and_plots_it(
        stack: tuple[TritonServer, harness.Sitsmesh], profiled: tuple[Any, Path]) -> None:
    prod, node = stack
    curve, plot = profiled
    sizes = [p["batch_size"] for p in curve["points"]]
    assert sizes == [1, 2, 4, 8, 16, 32]
    assert curve["knee"] == 16
    throughput = {p["batch_size"]: p["throughput"] for p in curve["points"]}
    assert throughput[16] > 8 * throughput[1]          # batching pays ...
    assert throughput[32] < 1.2 * throughput[16]       # ... up to the knee
    assert curve["target"] == "preflight"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Stored: the curve reads back; production was not touched.
    stored = _json(node.cli("models", "curve", MODEL, "-o", "json"))
    assert stored["knee"] == 16 and stored["points"] == curve["points"]
    assert _batching_in_force(prod) is None
    # Production without consent is refused; with it, paced under --max-rate.
    refused = node.cli("models", "profile", MODEL, "--production")
    assert refused.returncode != 0 and "consent" in refused.stderr
    began = time.monotonic()
    paced = _json(node.cli("models", "profile", MODEL, "--production", "--yes-production",
                           "--max-rate", "40", "--batch-sizes", "1,4", "--requests", "8",
                           "-o", "json", timeout=120))
    assert paced["target"] == "production"
    # 8 requests of 4 items at 40 items/s take at least 0.7 s (the first one unpaced).
    assert all(p["throughput"] <= 40 * 1.15 for p in paced["points"]), paced["points"]
    assert time.monotonic() - began >= 0.7
    # The production profile replaced the stored curve; the sandbox one comes back.
    assert _json(node.cli("models", "curve", MODEL, "-o", "json"))["target"] == "production"
    again = node.cli("models", "profile", MODEL, "--requests", "12", "-o", "json",
                     timeout=300)
    assert _json(again)["knee"] == 16
    table = node.cli("models", "curve", MODEL)
    assert "knee B* = 16" in table.stdout and "pareto" in table.stdout


def test_tuned_batching_holds_the_sla_where_untuned_collapses_and_applies_without_a_failure(
        stack: tuple[TritonServer, harness.Sitsmesh], profiled: tuple[Any, Path]) -> None:
    prod, node = stack
    dry = _json(node.cli("models", "tune", MODEL, "--dry-run", "--rate", str(RATE), "-o",
                         "json", timeout=60))["recommendation"]
    assert dry["sla_ms"] == SLA_MS and dry["stage"] == "model"  # the stage's own SLA
    assert not dry["current"].get("stable", False)             # untuned cannot keep up
    proposed = dry["proposed"]
    assert proposed["batching"]["enabled"] and proposed["p99_ms"] <= SLA_MS
    assert _batching_in_force(prod) is None                    # a dry run changes nothing

    with OpenLoop(prod.grpc_url, MODEL, RATE, 3.0) as untuned:
        pass
    # One at a time the queue only grows: most requests miss the SLA.
    assert untuned.p99_ms() > 5 * SLA_MS, untuned.p99_ms()

    # The change under load, the load within what the untuned config serves.
    with OpenLoop(prod.grpc_url, MODEL, 25.0, 12.0, seed=3) as during:
        time.sleep(1.0)
        result = node.cli("models", "tune", MODEL, "--rate", str(RATE), "--watch", "0",
                          "-o", "json", timeout=240)
    doc = _json(result)
    assert doc["swap"]["state"] == "succeeded", doc["swap"]
    assert during.errors == [] and len(during.latencies) == during.sent > 200
    # Warm: no request paid the 300 ms context of a cold instance.
    assert max(during.latencies) * 1000 < 250, max(during.latencies)
    in_force = _batching_in_force(prod)
    assert [int(s) for s in in_force["preferred_batch_size"]] == \
        proposed["batching"]["preferred_batch_size"]

    with OpenLoop(prod.grpc_url, MODEL, RATE, 3.0, seed=11) as tuned:
        pass
    assert tuned.errors == []
    assert tuned.p99_ms() <= SLA_MS, tuned.p99_ms()

    history = _json(node.cli("models", "batching-history", "--model", MODEL, "-o", "json"))
    change = history["changes"][0]
    assert change["outcome"] == "succeeded" and change["actor"].startswith("admin")
    assert change["batching"]["enabled"] and not change["previous"].get("enabled", False)


def test_a_config_triton_refuses_is_stopped_on_the_sandbox(
        stack: tuple[TritonServer, harness.Sitsmesh], profiled: tuple[Any, Path]) -> None:
    prod, node = stack
    before = _batching_in_force(prod)
    # A preferred size over max_batch_size 32: Triton will not load it.
    result = node.cli("models", "tune", MODEL, "--preferred", "64", "--delay-us", "1000",
                      "-o", "json", timeout=120)
    assert result.returncode != 0
    swap = json.loads(result.stdout)["swap"]
    assert swap["state"] == "failed" and swap["phase"] == "preflight"
    assert _batching_in_force(prod) == before


def test_auto_tuning_is_audited_and_bad_settings_are_refused(
        stack: tuple[TritonServer, harness.Sitsmesh]) -> None:
    _, node = stack
    shown = _json(node.cli("models", "autotune", "infer", "on", "--hold", "5", "-o", "json"))
    assert shown["enabled"] and shown["hold_s"] == 5
    assert _json(node.cli("models", "autotune", "infer", "-o", "json"))["enabled"]
    bad = node.cli("models", "autotune", "infer", "on", "--hold", "0.1")
    assert bad.returncode != 0 and "hold_s" in bad.stderr
    off = _json(node.cli("models", "autotune", "infer", "off", "-o", "json"))
    assert not off.get("enabled", False)
    history = _json(node.cli("models", "batching-history", "-o", "json"))
    reasons = [c["reason"] for c in history["changes"]]
    assert any(r.startswith("automatic tuning on") for r in reasons)


def test_bad_batching_requests_get_precise_errors_and_change_nothing(
        stack: tuple[TritonServer, harness.Sitsmesh]) -> None:
    prod, node = stack
    before = _batching_in_force(prod)
    channel = grpc.insecure_channel(node.admin_addr)
    stub = admin_pb2_grpc.AdminServiceStub(channel)

    def code(method: str, request: Any) -> tuple[grpc.StatusCode, str]:
        try:
            reply = getattr(stub, method)(request, metadata=node.admin_metadata(), timeout=20)
            list(reply)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
        return grpc.StatusCode.OK, ""

    bad = grpc.StatusCode.INVALID_ARGUMENT
    try:
        assert code("ProfileModel", admin_pb2.ProfileModelRequest(
            model=MODEL, batch_sizes=list(range(1, 18)))) == (
            bad, "batch_sizes: at most 16 distinct sizes, each >= 1")
        assert code("ProfileModel", admin_pb2.ProfileModelRequest(
            model=MODEL, concurrency=100_000))[0] == bad
        assert code("ProfileModel", admin_pb2.ProfileModelRequest(
            model=MODEL, seconds=1e9))[1] == "seconds must be 0.5-120, got 1000000000.0"
        assert code("ProfileModel", admin_pb2.ProfileModelRequest(
            model=MODEL, target=admin_pb2.PROFILE_TARGET_PRODUCTION, allow_production=True,
            max_rate=1e6))[1].startswith("max_rate 1e+06 is over 1000")
        assert code("TuneModel", admin_pb2.TuneModelRequest(
            model=MODEL, batching=admin_pb2.DynamicBatching(
                enabled=True, preferred_batch_size=[16, 8]))) == (
            bad, "preferred_batch_size: at most 16 distinct ascending sizes >= 1")
        assert code("TuneModel", admin_pb2.TuneModelRequest(
            model=MODEL, batching=admin_pb2.DynamicBatching(
                enabled=True, max_queue_delay_microseconds=10**12)))[0] == bad
        assert code("TuneModel", admin_pb2.TuneModelRequest(model=MODEL, watch_s=1e6))[0] == bad
        assert code("TuneModel", admin_pb2.TuneModelRequest(model="nope", dry_run=True))[0] == \
            grpc.StatusCode.NOT_FOUND
    finally:
        channel.close()
    assert _batching_in_force(prod) == before
