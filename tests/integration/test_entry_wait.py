"""Requests held at the pipeline's entry (entry_wait_ms) through real Envoy: Check keeps a
low-priority request that meets the in-flight cap until an access-log entry says a
request ended, then lets it in, highest priority first; past its wait it gets the 429
it would have got at once.

The stage is sitsmesh.dev.stagesvc: one worker, 25 ms a request. The cap is pinned at 1
(max_concurrency) so the test does not depend on what the controller learns.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.stagesvc import StageService

pytestmark = pytest.mark.integration

HIGH, LOW = 9, 0
PIPELINE = """name: plain
models: ["svc"]
stages:
  - name: svc
    match: {upstream_cluster: upstream}
    sla_p99_ms: 400
"""


@dataclass(frozen=True, slots=True)
class Reply:
    name: str
    status: int
    code: str
    retry_after: str
    done: float  # seconds after the burst started


@dataclass
class Stack:
    stage: StageService
    node: harness.Sitsmesh
    envoy: harness.Envoy
    key: str
    tmp: Path

    def thresholds(self, wait_ms: int) -> None:
        path = self.tmp / "thresholds.yaml"
        path.write_text(f"entry_wait_ms: {wait_ms}\nmax_concurrency: 1\n"
                        "stages:\n  svc: {parallelism: 1}\n")
        done = self.node.cli("thresholds", "set", "plain", str(path))
        assert done.returncode == 0, done.stderr

    def waits(self, outcome: str) -> float:
        return harness.metric_value(self.node.metrics(), "sitsmesh_entry_waits_total",
                                    pipeline="plain", outcome=outcome)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("entrywait")
    stage = StageService(name="svc", parallelism=1, service_ms=25).start()
    node = envoy = None
    try:
        node = harness.start_sitsmesh(tmp)
        (tmp / "plain.yaml").write_text(PIPELINE)
        for args in (("pipelines", "apply", str(tmp / "plain.yaml")),
                     ("tenants", "create", "acme", "--models", "*", "--priority", "0",
                      "--max-priority", "9")):
            done = node.cli(*args)
            assert done.returncode == 0, done.stderr
        key = json.loads(node.cli("apikeys", "create", "--tenant", "acme", "--output",
                                  "json").stdout)["key"]
        envoy = harness.start_envoy(tmp, node.data_addr, stage.port,
                                    fragments=["ext_authz", "access_log"],
                                    access_log_flush="0.02s")
        made = Stack(stage, node, envoy, key, tmp)
        made.thresholds(150)
        # The controller caps in-flight requests once it knows the stage's capacity.
        for _ in range(12):
            assert _call(made, "warm", LOW, time.monotonic()).status == 200
        harness.wait_until(lambda: node.pressure("plain").concurrency == 1, 20,
                           "the in-flight cap of 1")
        yield made
    finally:
        for proc in (envoy, node):
            if proc is not None:
                proc.kill()
        stage.stop()


def _call(stack: Stack, name: str, priority: int, start: float) -> Reply:
    request = urllib.request.Request(stack.envoy.url("/v2/models/svc/infer"), data=b"{}",
                                     method="POST", headers={"x-api-key": stack.key,
                                                             "x-priority": str(priority)})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            reply.read()
            status, code, retry = reply.status, "", ""
    except urllib.error.HTTPError as exc:
        body = exc.read()
        status, retry = exc.code, exc.headers.get("retry-after", "")
        try:
            code = json.loads(body).get("code", "")
        except ValueError:
            code = body[:40].decode(errors="replace")
    return Reply(name, status, code, retry, time.monotonic() - start)


def _burst(stack: Stack, plan: list[tuple[str, int, float]]) -> dict[str, Reply]:
    """Each (name, priority, delay s) sent from its own thread at its delay."""
    replies: dict[str, Reply] = {}
    start = time.monotonic()

    def send(name: str, priority: int, delay: float) -> None:
        time.sleep(delay)
        replies[name] = _call(stack, name, priority, start)

    threads = [threading.Thread(target=send, args=item, daemon=True) for item in plan]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert len(replies) == len(plan)
    return replies


def _settled(stack: Stack) -> None:
    harness.wait_until(lambda: stack.stage.stats().in_flight == 0 and
                       stack.node.pressure("plain").in_flight < 0.5, 10, "the stage idle")


def test_requests_at_the_cap_wait_for_room_and_the_stage_sees_one_at_a_time(
        stack: Stack) -> None:
    _settled(stack)
    # WatchPressure and `pressure watch` say that requests wait, and for how long.
    assert stack.node.pressure("plain").entry_wait_ms == 150
    before = stack.stage.stats()
    let_in = stack.waits("let_in")
    replies = _burst(stack, [(f"low{i}", LOW, 0.0) for i in range(3)])
    assert {r.status for r in replies.values()} == {200}, replies
    after = stack.stage.stats()
    assert after.served - before.served == 3
    # Held at the entry, not all sent to the stage at once: the gate meets the cap with
    # its count less the requests most likely ended, whose entries are on the way (one,
    # under load), so the stage may see two at a time, never the burst's three.
    assert after.in_flight_max <= 2, after
    harness.wait_until(lambda: stack.waits("let_in") - let_in >= 2, 5, "2 waits let in")


def test_without_a_wait_the_same_burst_is_refused_at_once(stack: Stack) -> None:
    stack.thresholds(0)
    try:
        _settled(stack)
        replies = _burst(stack, [(f"low{i}", LOW, 0.0) for i in range(3)])
        refused = [r for r in replies.values() if r.status == 429]
        assert refused and {r.code for r in refused} == {"concurrency"}, replies
    finally:
        stack.thresholds(150)


def test_high_priority_never_waits_and_goes_ahead_of_the_waiting_low_priority(
        stack: Stack) -> None:
    _settled(stack)
    plan = [("first", LOW, 0.0), ("low1", LOW, 0.005), ("low2", LOW, 0.01),
            ("high", HIGH, 0.02)]
    replies = _burst(stack, plan)
    assert {r.status for r in replies.values()} == {200}, replies
    # high went straight to the stage, behind only `first`; low1 and low2 waited for
    # room, and the second of them for high's end too.
    assert replies["high"].done < max(replies["low1"].done, replies["low2"].done), replies


def test_past_its_wait_a_request_gets_the_429_it_would_have_got(stack: Stack) -> None:
    _settled(stack)
    waited_out = stack.waits("waited_out")
    replies = _burst(stack, [(f"low{i}", LOW, 0.0) for i in range(8)])
    refused = [r for r in replies.values() if r.status != 200]
    assert refused, replies
    # Envoy's ext_authz timeout (0.25 s) is longer than the wait: sitsmesh answers.
    assert {(r.status, r.code) for r in refused} == {(429, "concurrency")}, refused
    assert all(r.retry_after and r.done >= 0.14 for r in refused), refused
    # Published with the controller's next tick.
    harness.wait_until(lambda: stack.waits("waited_out") - waited_out == len(refused), 5,
                       f"{len(refused)} waits counted waited_out")
    assert sum(r.status == 200 for r in replies.values()) >= 2


def test_a_wait_past_envoys_timeout_leaves_no_slot_taken(stack: Stack) -> None:
    """A wait longer than Envoy's ext_authz timeout: Envoy gives up on the Check (403,
    its status_on_error) and sitsmesh drops the waiter; nothing stays held."""
    stack.thresholds(2000)
    try:
        _settled(stack)
        gone = stack.waits("gone")
        replies = _burst(stack, [(f"low{i}", LOW, 0.0) for i in range(16)])
        assert any(r.status == 403 for r in replies.values()), replies
        harness.wait_until(lambda: stack.waits("gone") > gone, 10, "a waiter counted gone")
        _settled(stack)
        assert _call(stack, "after", LOW, time.monotonic()).status == 200
    finally:
        stack.thresholds(150)
