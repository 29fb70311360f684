"""Backpressure end to end: real Envoy (ext_authz + access logs to sitsmesh) in front of a
real Triton model with a fixed 20 ms service time and one instance (about 45 requests/s
here), driven at about twice that, 30 % of it at high priority: once with a 20 ms
access-log flush and tuned thresholds, once as a new user runs it (Envoy's default 1 s
flush, default thresholds).
"""

from __future__ import annotations

import json
import queue
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as triton_grpc

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.dev import demo_model, harness
from sitsmesh.dev.triton import TritonServer

pytestmark = pytest.mark.integration

MODEL = "lazy"
SLA_MS = 250.0
HIGH, LOW = 9, 0
BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                               "data": [1, 2, 3, 4]}]}).encode()
PIPELINE = f"""name: demo
models: ["{MODEL}"]
stages:
  - name: model
    match: {{upstream_cluster: upstream}}
    sla_p99_ms: {SLA_MS:g}
    triton_model: {MODEL}
"""
THRESHOLDS = """policy: sitsmesh
shed_priorities: [0, 1, 2, 3, 4]
stages:
  model: {queue_capacity: 32, parallelism: 1}
"""
# As a new user runs it: Envoy's and Istio's default 1 s access-log flush, and nothing
# set but the pipeline (Triton's model config gives the stage's parallelism).
DEFAULTS = "policy: sitsmesh\n"


@dataclass(frozen=True, slots=True)
class Result:
    sent: float
    priority: int
    status: int
    seconds: float
    retry_after: str
    code: str


@dataclass
class Stack:
    triton: TritonServer
    node: harness.Sitsmesh
    envoy: harness.Envoy
    key: str


@pytest.fixture(params=[("0.02s", THRESHOLDS), ("1s", DEFAULTS)],
                ids=["flush-20ms-tuned", "flush-1s-defaults"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    flush, thresholds = request.param
    repo = tmp_path / "models"
    demo_model.write_lazy_model(repo, MODEL, [1], context_ms=20, service_ms=20)
    triton = TritonServer(tmp_path / "triton", repo)
    triton.start()
    node = envoy = None
    try:
        client = triton_grpc.InferenceServerClient(triton.grpc_url)
        client.load_model(MODEL)
        client.close()
        node = harness.start_sitsmesh(tmp_path, "--triton-url", triton.grpc_url,
                                      "--triton-metrics-url", triton.metrics_url)
        (tmp_path / "demo.yaml").write_text(PIPELINE)
        (tmp_path / "thresholds.yaml").write_text(thresholds)
        for args in (("pipelines", "apply", str(tmp_path / "demo.yaml")),
                     ("thresholds", "set", "demo", str(tmp_path / "thresholds.yaml")),
                     ("tenants", "create", "acme", "--models", "*", "--priority", "0",
                      "--max-priority", "9")):
            done = node.cli(*args)
            assert done.returncode == 0, done.stderr
        made = node.cli("apikeys", "create", "--tenant", "acme", "--output", "json")
        key = json.loads(made.stdout)["key"]
        envoy = harness.start_envoy(tmp_path, node.data_addr, triton.http_port,
                                    fragments=["ext_authz", "access_log"],
                                    access_log_flush=flush)
        yield Stack(triton, node, envoy, key)
    finally:
        for proc in (envoy, node):
            if proc is not None:
                proc.kill()
        triton.kill()


def _drive(stack: Stack, rate: float, seconds: float, high_share: float,
           workers: int = 48) -> list[Result]:
    """Open loop: request i is due at start + i / rate, whatever came back before."""
    url = stack.envoy.url(f"/v2/models/{MODEL}/infer")
    due: queue.Queue[tuple[float, int] | None] = queue.Queue()
    start = time.monotonic() + 0.2
    total = int(rate * seconds)
    for i in range(total):
        # Every tenth request slot: the first `high_share` of them are high priority.
        due.put((start + i / rate, HIGH if (i % 10) < high_share * 10 else LOW))
    results: list[Result] = []
    lock = threading.Lock()

    def work() -> None:
        while (item := due.get()) is not None:
            at, priority = item
            time.sleep(max(0.0, at - time.monotonic()))
            request = urllib.request.Request(url, data=BODY, method="POST", headers={
                "x-api-key": stack.key, "x-priority": str(priority),
                "content-type": "application/json"})
            began = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    reply.read()
                    status, retry, code = reply.status, "", ""
            except urllib.error.HTTPError as exc:
                body = exc.read()
                status, retry = exc.code, exc.headers.get("retry-after", "")
                code = json.loads(body).get("code", "") if body.startswith(b"{") else ""
            with lock:
                results.append(Result(at - start, priority, status,
                                      time.monotonic() - began, retry, code))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for _ in threads:
        due.put(None)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    return sorted(results, key=lambda r: r.sent)



def test_overload_sheds_low_priority_keeps_high_within_sla_and_recovers(
        stack: Stack) -> None:
    calm = _drive(stack, rate=15, seconds=2, high_share=0.3)
    assert {r.status for r in calm} == {200}, "under capacity nothing is shed"

    results = _drive(stack, rate=90, seconds=8, high_share=0.3)
    steady = [r for r in results if r.sent >= 2.0]  # after the controller settled
    high = [r for r in steady if r.priority == HIGH]
    low = [r for r in steady if r.priority == LOW]
    assert high and low
    assert all(r.status == 200 for r in high), {r.status for r in high}
    high_ms = sorted(r.seconds * 1000 for r in high)
    assert high_ms[int(0.99 * (len(high_ms) - 1))] <= SLA_MS, high_ms[-10:]
    shed = [r for r in low if r.status == 429]
    assert len(shed) > 0.2 * len(low)
    assert all(r.retry_after.isdigit() and int(r.retry_after) >= 1 for r in shed)
    assert {r.code for r in shed} <= {"admission_level", "concurrency"}
    admitted_low = [r.seconds * 1000 for r in low if r.status == 200]
    if admitted_low:
        assert statistics.median(admitted_low) <= SLA_MS

    metrics = stack.node.metrics()
    shed_low = sum(harness.metric_value(metrics, "sitsmesh_shed_total", pipeline="demo",
                                        stage="model", priority="0", reason=reason)
                   for reason in ("admission_level", "concurrency")
                   if f'reason="{reason}"' in metrics)
    assert shed_low >= len(shed)
    assert 'priority="9"' not in "".join(
        line for line in metrics.splitlines() if line.startswith("sitsmesh_shed_total"))

    # The load drops: admission is back to everything within a few ticks.
    dropped = time.monotonic()
    while True:
        pressure = stack.node.pressure("demo")
        if pressure.fraction == 1.0 and pressure.level == admin_pb2.PRESSURE_LEVEL_OK:
            break
        assert time.monotonic() - dropped < 2.0, f"no recovery within 2 s: {pressure}"
        time.sleep(0.05)
    after = _drive(stack, rate=15, seconds=1, high_share=0.0)
    assert {r.status for r in after} == {200}
