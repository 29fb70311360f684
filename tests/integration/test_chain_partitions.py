"""Two replicas on a real redis-server split the chains by request id: each assembles
about half of them (its Prometheus histograms count only those), and both answer
GetLatencyChain as one process that assembled every chain does."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis as redis_py

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.chains.assembler import Hop
from sitsmesh.dev import harness
from sitsmesh.dev.redis import RedisServer, redis_server
from sitsmesh.shared.chainshares import PREFIX
from sitsmesh.shared.hopbus import DEFAULT_KEY as HOPBUS_KEY
from sitsmesh.shared.hopbus import decode
from sitsmesh.shared.partitions import MEMBERS_KEY, PARTITIONS, owned, partition_of, stream_key
from tests.integration.test_shared_runtime import PIPELINE
from tests.sharedstack import chain_report, replicas, settled, timed_report, watch

Start = Callable[..., harness.Sitsmesh]
CHAINS = 80


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as server:
        yield server


def _admin(node: harness.Sitsmesh) -> admin_pb2_grpc.AdminServiceStub:
    return admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(node.admin_addr))


def _apply(node: harness.Sitsmesh) -> None:
    _admin(node).ApplyPipeline(admin_pb2.ApplyPipelineRequest(yaml=PIPELINE),
                               metadata=node.admin_metadata(), timeout=5)


def _known_on(node: harness.Sitsmesh) -> None:
    """Wait until `node` has loaded the pipeline applied on another replica."""
    harness.wait_until(lambda: len(_admin(node).ListPipelines(
        admin_pb2.ListPipelinesRequest(), metadata=node.admin_metadata(), timeout=5).pipelines)
        == 1, 5, "the pipeline on the other replica")


def _with_single(start: Start, tmp_path: Path, redis: RedisServer
                 ) -> tuple[harness.Sitsmesh, harness.Sitsmesh, harness.Sitsmesh]:
    """Two replicas and one unshared process, the pipeline applied on the first and it."""
    a, b = replicas(start, tmp_path / "state", redis.url)
    single = start("--reload-interval-seconds", "0.2", name="single")
    for node in (a, single):
        _apply(node)
    return a, b, single


def _assembled(node: harness.Sitsmesh) -> float:
    return harness.metric_value(node.metrics(), "sitsmesh_pipeline_latency_seconds_count",
                                pipeline="trio")


def test_each_replica_assembles_its_share_and_both_answer_as_one_process(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b, single = _with_single(start_sitsmesh, tmp_path, redis)
    _known_on(b)
    t0 = time.time()
    for n in range(CHAINS):
        pre, feat, model = 0.004 + n * 0.0001, 0.008 + (n % 7) * 0.001, 0.02 + n * 0.0003
        spans = [("pre", 0.0, pre), ("feat", pre, feat), ("model", pre + feat, model)]
        at = t0 + n * 0.05
        timed_report(single, f"q{n}", at, spans)
        # Whichever replica a hop reaches: the first on one, the rest on the other.
        first, rest = (a, b) if n % 2 else (b, a)
        timed_report(first, f"q{n}", at, spans[:1])
        timed_report(rest, f"q{n}", at, spans[1:])
    harness.wait_until(lambda: _assembled(a) + _assembled(b) == CHAINS, 5,
                       "every chain assembled once in the fleet")
    # The split is the partitions': a replica assembles exactly its requests' chains.
    members = [str(m) for m in redis_py.Redis.from_url(redis.url, decode_responses=True)
               .zrange(MEMBERS_KEY, 0, -1)]
    assert len(members) == 2
    mine = owned(members[0], members)
    expected = sum(partition_of(f"q{n}") in mine for n in range(CHAINS))
    assert sorted((_assembled(a), _assembled(b))) == sorted((expected, CHAINS - expected))
    assert 0 < expected < CHAINS and 0 < len(mine) < PARTITIONS
    one = chain_report(single)
    assert one.chains == CHAINS and one.slowest
    harness.wait_until(lambda: chain_report(a) == one == chain_report(b), 5,
                       "both replicas report what one process does")



def _owned(node: harness.Sitsmesh) -> float:
    return harness.metric_value(node.metrics(), "sitsmesh_hop_partitions_owned")


def test_a_replica_that_stops_hands_its_partitions_over_and_its_chains_still_count(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b = replicas(start_sitsmesh, tmp_path / "state", redis.url)
    _apply(a)
    _known_on(b)
    t0 = time.time()
    spans = [("pre", 0.0, 0.004), ("feat", 0.004, 0.008), ("model", 0.012, 0.02)]
    for n in range(20):
        timed_report(a, f"before-{n}", t0 + n * 0.01, spans[:1])
        timed_report(b, f"before-{n}", t0 + n * 0.01, spans[1:])
    harness.wait_until(lambda: chain_report(a).chains == 20 == chain_report(b).chains, 5,
                       "every chain on both")
    on_b = _assembled(b)
    assert 0 < on_b < 20
    assert b.stop() == 0
    # b left the members and freed its leases on the way out: a takes over at its next beat.
    harness.wait_until(lambda: _owned(a) == PARTITIONS, 5, "a owns every partition")
    for n in range(20):
        timed_report(a, f"after-{n}", t0 + n * 0.01, spans)
    harness.wait_until(lambda: chain_report(a).chains == 40, 5, "the new chains on a")
    report = chain_report(a)
    assert (report.chains, report.incomplete) == (40, 0)  # b's chains still count
    assert _assembled(a) == 40 - on_b



def test_a_replica_killed_loses_no_hop_published_after_its_death(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    """Its heartbeat and leases lapse, the other takes its partitions over where it had
    read to, and the hops that waited meanwhile are assembled whole."""
    a, b = replicas(start_sitsmesh, tmp_path / "state", redis.url)
    _apply(a)
    _known_on(b)
    client = redis_py.Redis.from_url(redis.url, decode_responses=True)
    t0 = time.time()
    spans = [("pre", 0.0, 0.004), ("feat", 0.004, 0.008), ("model", 0.012, 0.02)]
    for n in range(20):
        timed_report(a, f"before-{n}", t0 + n * 0.01, spans)
    # Chains that never complete, some of them open on b when it dies.
    for n in range(12):
        timed_report(a, f"open-{n}", t0, spans[:1])
    harness.wait_until(lambda: chain_report(a).chains == 20 == chain_report(b).chains, 5,
                       "every chain on both")
    b_name = f"{socket.gethostname()}:{b.proc.pid}"
    members = [str(m) for m in client.zrange(MEMBERS_KEY, 0, -1)]
    on_b_partitions = owned(b_name, members)
    open_on_b = sum(partition_of(f"open-{n}") in on_b_partitions for n in range(12))
    assert b_name in members and 0 < open_on_b < 12

    def saved_to_the_end() -> bool:
        """Every partition's cursor names its stream's last entry (nothing is read twice),
        and b's count the chains open there."""
        opened = 0
        for p in range(PARTITIONS):
            newest = client.xrevrange(stream_key(p), count=1)
            cursor, _, count = str(client.get(f"sitsmesh:{{hops:{p}}}:cursor")).partition(" ")
            if newest and cursor != newest[0][0]:
                return False
            opened += int(count or 0) if p in on_b_partitions else 0
        return opened == open_on_b

    harness.wait_until(saved_to_the_end, 5, "the cursors saved")
    on_b = _assembled(b)
    b.kill()
    for n in range(20):  # published while b's partitions have no reader
        timed_report(a, f"after-{n}", t0 + n * 0.01, spans)
    harness.wait_until(lambda: _owned(a) == PARTITIONS, 15, "a owns every partition")
    harness.wait_until(lambda: chain_report(a).chains == 40, 5, "the waiting hops assembled")
    report = chain_report(a)
    assert report.chains == 40
    assert _assembled(a) == 40 - on_b
    assert harness.metric_value(a.metrics(), "sitsmesh_chains_lost_total") == open_on_b


def _capacity(node: harness.Sitsmesh, stage: str) -> float:
    """The stage capacity the replica's controller has learned (0 before it has)."""
    return next(s.capacity for s in watch(node, "trio").stages if s.name == stage)


def test_every_controller_adds_up_the_owners_sums_and_no_hop_goes_to_every_replica(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    a, b, single = _with_single(start_sitsmesh, tmp_path, redis)
    settled(a, b)
    # Live traffic for about 3 s: 30 requests every 0.1 s, each "model" call 20-40 ms
    # with about one running at a time, its hops split over the replicas as they come.
    sent = 0
    for _ in range(30):
        now = time.time()
        for k in range(30):
            n = sent + k
            model = 0.02 + (n % 5) * 0.005
            spans = [("pre", 0.0, 0.002), ("model", 0.002, model)]
            at = now - 0.15 + k * 0.0033
            timed_report(single, f"c{n}", at, spans)
            timed_report((a, b)[n % 2], f"c{n}", at, spans)
        sent += 30
        time.sleep(max(0.0, now + 0.1 - time.time()))
    client = redis_py.Redis.from_url(redis.url, decode_responses=True)
    entries: Any = client.xrange(HOPBUS_KEY)
    events = [event for _, fields in entries for event in json.loads(fields["b"])]
    kinds = {event[0] for event in events if isinstance(event, list) and event}
    # What crosses to every replica is each owner's sums, not a hop's completion.
    assert "w" in kinds and "C" not in kinds
    members: Any = client.zrange(MEMBERS_KEY, 0, -1)
    assert {event[2] for event in events if event[0] == "w"} >= set(members)
    assert len(events) < sent  # per tick, not per hop
    want = _capacity(single, "model")
    assert want > 0
    for name, node in (("a", a), ("b", b)):
        got = _capacity(node, "model")
        # Read per 10 ms bin the busy time is never less than per instant: the capacity
        # at most a little lower (pressure/work.py), never more.
        assert want * 0.75 <= got <= want * 1.1, (name, got, want)


def _stream_id(raw: str) -> tuple[int, int]:
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq)


def test_what_redis_holds_of_cursors_and_tallies_always_agrees(
        start_sitsmesh: Start, tmp_path: Path, redis: RedisServer) -> None:
    """A successor resumes at the saved cursors and the dead replica's tallies stay: if
    the tallies counted chains completed past the cursors, a crash counted them twice.
    Sampled atomically while chains flow, each replica's tallies count exactly the
    chains whose hops all lie before its partitions' cursors."""
    a, b = replicas(start_sitsmesh, tmp_path / "state", redis.url)
    _apply(a)
    _known_on(b)
    settled(a, b)
    client = redis_py.Redis.from_url(redis.url, decode_responses=True)
    members: Any = client.zrange(MEMBERS_KEY, 0, -1)
    mine = {m: owned(m, members) for m in members}
    spans = [("pre", 0.0, 0.004), ("feat", 0.004, 0.008), ("model", 0.012, 0.02)]
    done = threading.Event()

    failed: list[BaseException] = []

    def send() -> None:
        t0 = time.time()
        try:
            for n in range(400):
                timed_report((a, b)[n % 2], f"k{n}", t0 + n * 0.005, spans)
                time.sleep(0.004)
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    checked = 0
    while not done.is_set() or checked < 3:
        with client.pipeline(transaction=True) as pipe:
            for p in range(PARTITIONS):
                pipe.get(f"sitsmesh:{{hops:{p}}}:cursor")
                pipe.xrange(stream_key(p))
            for m in members:
                pipe.hgetall(PREFIX + m)
            replies: Any = pipe.execute()
        for m in members:
            whole: dict[str, int] = {}
            for p in mine[m]:
                cursor = (replies[2 * p] or "").partition(" ")[0]
                for entry_id, fields in replies[2 * p + 1]:
                    if not cursor or _stream_id(entry_id) > _stream_id(cursor):
                        break
                    for event in json.loads(fields["b"]):
                        hop = decode(event)
                        if isinstance(hop, Hop):
                            whole[hop.request_id] = whole.get(hop.request_id, 0) + 1
            tallied = sum(json.loads(raw)["trio"][0]
                          for raw in replies[2 * PARTITIONS + members.index(m)].values())
            assert tallied == sum(n == 3 for n in whole.values()), (m, checked)
        checked += 1
        time.sleep(0.13)
    sender.join(10)
    assert not failed, failed
    harness.wait_until(lambda: chain_report(a).chains == 400 == chain_report(b).chains, 5,
                       "every chain counted once, on both")
    assert checked >= 10
