"""Latency chains end to end: three chained Envoy hops -> access logs -> sitsmesh chains.

See tests/chainstack.py for the topology (L1 -> P -> L2 -> F -> L3 -> M).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from tests import chainstack

Start = Callable[..., harness.Sitsmesh]

FAULT_MS = 120.0
N = 60               # sequential requests per scenario
FLUSH_TIMEOUT_S = 15.0


class Admin:
    def __init__(self, node: harness.Sitsmesh) -> None:
        self._channel = grpc.insecure_channel(node.admin_addr)
        self.stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        self.md = node.admin_metadata()

    def close(self) -> None:
        self._channel.close()

    def apply_demo(self) -> None:
        reply = self.stub.ApplyPipeline(
            admin_pb2.ApplyPipelineRequest(yaml=chainstack.PIPELINE_YAML, source="demo.yaml"),
            metadata=self.md, timeout=10)
        assert reply.pipeline.name == "demo"

    def chain(self) -> admin_pb2.LatencyChain:
        reply: admin_pb2.LatencyChain = self.stub.GetLatencyChain(
            admin_pb2.GetLatencyChainRequest(pipeline="demo", window="1m"),
            metadata=self.md, timeout=10).chain
        return reply

    def wait_chains(self, at_least: int, timeout: float = FLUSH_TIMEOUT_S
                    ) -> admin_pb2.LatencyChain:
        deadline = time.monotonic() + timeout
        reply = self.chain()
        while reply.chains < at_least and time.monotonic() < deadline:
            time.sleep(0.1)
            reply = self.chain()
        assert reply.chains >= at_least, f"only {reply.chains} of {at_least} chains: {reply}"
        return reply


def stages(reply: admin_pb2.LatencyChain) -> dict[str, admin_pb2.StageLatencyReport]:
    return {s.name: s for s in reply.stages}


def describe(reply: admin_pb2.LatencyChain) -> str:
    rows = [f"chains={reply.chains} incomplete={reply.incomplete} "
            f"e2e_p50={reply.e2e_p50_ms} e2e_p99={reply.e2e_p99_ms} "
            f"bottleneck={reply.bottleneck!r}"]
    for s in reply.stages:
        ttfb = s.ttfb_p99_ms if s.HasField("ttfb_p99_ms") else None
        total = s.total_p99_ms if s.HasField("total_p99_ms") else None
        rows.append(f"  {s.name}: p50={s.p50_ms} p99={s.p99_ms} attributed={s.attributed_ms} "
                    f"share={s.share_of_e2e_p99} ttfb_p99={ttfb} total_p99={total}")
    return "\n".join(rows)


@pytest.fixture
def admin(sitsmesh: harness.Sitsmesh) -> Iterator[Admin]:
    client = Admin(sitsmesh)
    yield client
    client.close()


def _run(tmp_path: Path, node: harness.Sitsmesh, admin: Admin, *, fault_on: str | None,
         path: str = "/", count: int = N) -> admin_pb2.LatencyChain:
    with chainstack.chain_stack(tmp_path, node.data_addr, fault_on=fault_on) as stack:
        # Warm the connections before the pipeline exists: these chains match nothing.
        for _ in range(3):
            status, _body = stack.get(path)
            assert status == 200
        time.sleep(0.5)  # > the 0.1 s access-log flush
        admin.apply_demo()
        assert admin.chain().chains == 0
        seen: set[bytes] = set()
        for _ in range(count):
            status, body = stack.get(path)
            assert status == 200, body
            seen.add(body)
        # Every request got its own id, and M saw the id L1 generated.
        assert len(seen) == count
        reply = admin.wait_chains(count)
        print(f"\n[{fault_on or 'no fault'} {path}]\n{describe(reply)}")
        return reply


def test_fault_on_feat_makes_feat_the_bottleneck(tmp_path: Path, sitsmesh: harness.Sitsmesh,
                                                 admin: Admin) -> None:
    reply = _run(tmp_path, sitsmesh, admin, fault_on="L2")
    by_name = stages(reply)
    assert reply.chains == N and reply.incomplete == 0, describe(reply)
    assert reply.bottleneck == "feat", describe(reply)
    # feat's own time = the 120 ms fault delay + F's own work (a local HTTP call: ~ms).
    assert FAULT_MS * 0.85 <= by_name["feat"].attributed_ms <= FAULT_MS * 1.15, describe(reply)
    assert by_name["pre"].attributed_ms < 100 and by_name["model"].attributed_ms < 100
    # Every chain carries the delay, not only the slowest one (histogram upper bounds: +4.4 %).
    assert FAULT_MS <= by_name["feat"].p50_ms <= FAULT_MS * 1.15 + 5, describe(reply)
    assert by_name["pre"].p99_ms < 100 and by_name["model"].p99_ms < 100, describe(reply)
    assert reply.e2e_p50_ms >= FAULT_MS


def test_without_fault_no_stage_reaches_100ms(tmp_path: Path, sitsmesh: harness.Sitsmesh,
                                              admin: Admin) -> None:
    reply = _run(tmp_path, sitsmesh, admin, fault_on=None)
    assert reply.chains == N and reply.incomplete == 0, describe(reply)
    for stage in reply.stages:
        assert stage.attributed_ms < 100, describe(reply)
        assert stage.p99_ms < 100, describe(reply)
    assert reply.e2e_p99_ms < 100, describe(reply)


def test_streaming_model_ttfb_and_total(tmp_path: Path, sitsmesh: harness.Sitsmesh,
                                        admin: Admin) -> None:
    count = 30
    reply = _run(tmp_path, sitsmesh, admin, fault_on=None, path="/stream", count=count)
    model = stages(reply)["model"]
    delay_ms = chainstack.STREAM_DELAY_S * 1000
    assert reply.chains == count, describe(reply)
    assert model.HasField("ttfb_p99_ms") and model.HasField("total_p99_ms"), describe(reply)
    assert model.ttfb_p99_ms < 50, describe(reply)
    assert delay_ms * 0.95 <= model.total_p99_ms <= delay_ms * 1.05 + 30, describe(reply)
    assert reply.bottleneck == "model", describe(reply)


def _stamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def test_reported_hops_out_of_order_with_duplicate_count_once(admin: Admin) -> None:
    admin.apply_demo()
    before = admin.chain()
    assert before.chains == 0
    t = time.time()

    def hop(stage: str, start_ms: float, end_ms: float) -> admin_pb2.ReportStageLatencyRequest:
        return admin_pb2.ReportStageLatencyRequest(request_id="rid-out-of-order", pipeline="demo",
                                      stage=stage, start=_stamp(t + start_ms / 1000),
                                      end=_stamp(t + end_ms / 1000))

    # Innermost first, feat twice (the second is a resend), the outermost last.
    reports = [hop("model", 20, 200), hop("feat", 10, 250), hop("feat", 10, 250),
               hop("pre", 0, 300)]
    result = admin.stub.ReportStageLatency(iter(reports), metadata=admin.md, timeout=10)
    assert result.accepted == 4 and result.rejected == 0
    reply = admin.wait_chains(1, timeout=5)
    time.sleep(0.3)
    reply = admin.chain()
    print(f"\n[reported]\n{describe(reply)}")
    assert reply.chains == 1 and reply.incomplete == 0, describe(reply)
    by_name = stages(reply)
    # Own time: pre 300-240, feat 240-180, model 180.
    assert by_name["pre"].attributed_ms == pytest.approx(60, abs=0.01)
    assert by_name["feat"].attributed_ms == pytest.approx(60, abs=0.01)
    assert by_name["model"].attributed_ms == pytest.approx(180, abs=0.01)
    assert reply.bottleneck == "model"


TTL_S = 2.0


def test_missing_hops_count_as_incomplete_after_ttl(tmp_path: Path,
                                                    start_sitsmesh: Start) -> None:
    """P answers /short itself: only the pre hop arrives, and the chain expires."""
    node = start_sitsmesh("--chain-ttl-seconds", str(TTL_S))
    client = Admin(node)
    try:
        with chainstack.chain_stack(tmp_path, node.data_addr) as stack:
            client.apply_demo()
            for _ in range(5):
                assert stack.get("/")[0] == 200
            for _ in range(3):
                assert stack.get("/short") == (200, b"short")
            reply = client.wait_chains(5)
            # Expiry runs every second: TTL + 2 s is the bound.
            deadline = time.monotonic() + TTL_S + 5
            while reply.incomplete < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
                reply = client.chain()
            print(f"\n[missing hops]\n{describe(reply)}")
            assert reply.chains == 5 and reply.incomplete == 3, describe(reply)
    finally:
        client.close()


def test_late_duplicate_after_completion_is_not_an_incomplete_chain(
        start_sitsmesh: Start) -> None:
    node = start_sitsmesh("--chain-ttl-seconds", str(TTL_S))
    client = Admin(node)
    try:
        client.apply_demo()
        t = time.time()

        def hop(stage: str, start_ms: float, end_ms: float) -> admin_pb2.ReportStageLatencyRequest:
            return admin_pb2.ReportStageLatencyRequest(request_id="rid-late-dup", pipeline="demo",
                                          stage=stage, start=_stamp(t + start_ms / 1000),
                                          end=_stamp(t + end_ms / 1000))

        reports = [hop("pre", 0, 300), hop("feat", 10, 250), hop("model", 20, 200)]
        result = client.stub.ReportStageLatency(iter(reports), metadata=client.md, timeout=10)
        assert result.accepted == 3
        client.wait_chains(1, timeout=5)
        # The same feat entry again, after the chain has closed (a resend).
        result = client.stub.ReportStageLatency(iter([hop("feat", 10, 250)]),
                                                metadata=client.md, timeout=10)
        assert result.accepted == 1
        time.sleep(TTL_S + 2.5)
        reply = client.chain()
        print(f"\n[late duplicate]\n{describe(reply)}")
        assert reply.chains == 1, describe(reply)
        assert reply.incomplete == 0, describe(reply)
    finally:
        client.close()
