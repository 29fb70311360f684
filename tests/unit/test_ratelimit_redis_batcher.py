"""RedisStore's batching with a fake wire: calls of one event-loop turn share one send,
each caller gets its own replies in order, at most MAX_IN_FLIGHT batches are out, and a
failed or abandoned batch touches only its own callers; on a cluster each master batches
on its own, so a request spread over masters is answered in order and a failed or stalled
master costs only its own calls. The real wire: tests/integration/test_redis_cluster.py."""

from __future__ import annotations

import asyncio

import pytest

from sitsmesh.ratelimit import redis_store
from sitsmesh.ratelimit.config import Algorithm
from sitsmesh.ratelimit.redis_store import MAX_IN_FLIGHT, Batcher, RedisStore
from sitsmesh.ratelimit.rediswire import Call, script
from sitsmesh.ratelimit.store import Count, Hit

FIXED = script("return 1", 1)
T = 1_700_006_410.0


def calls(*keys: str) -> list[Call]:
    return [(FIXED, (key, 1)) for key in keys]


class Wire:
    """Answers each call with its key; holds every batch until `release` (when gated)."""

    def __init__(self, gated: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.gates: list[asyncio.Event] = []
        self.gated = gated
        self.fail: Exception | None = None

    async def send(self, batch: list[Call]) -> list[object]:
        keys = [str(args[0]) for _, args in batch]
        self.batches.append(keys)
        gate = asyncio.Event()
        self.gates.append(gate)
        if self.gated:
            await gate.wait()
        if self.fail is not None:
            raise self.fail
        return list(keys)

    def release(self, n: int) -> None:
        self.gates[n].set()


async def settle(wire: Wire, batches: int) -> None:
    for _ in range(100):  # bounded: a few loop turns are enough
        if len(wire.batches) >= batches:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(wire.batches)} batches sent, expected {batches}")


async def test_one_turns_calls_share_one_send_and_get_their_own_replies_in_order() -> None:
    wire = Wire()
    batcher = Batcher(wire.send)
    futures = [batcher.queue(calls("a", "b")), batcher.queue(calls("c")),
               batcher.queue(calls("d", "e", "f"))]
    assert await asyncio.gather(*futures) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert wire.batches == [["a", "b", "c", "d", "e", "f"]]


async def test_calls_wait_while_the_in_flight_batches_are_out_then_go_together() -> None:
    wire = Wire(gated=True)
    batcher = Batcher(wire.send)
    first = []
    for n in range(MAX_IN_FLIGHT):  # each in its own turn: its own batch
        first.append(batcher.queue(calls(f"k{n}")))
        await settle(wire, n + 1)
    waiting = [batcher.queue(calls("x")), batcher.queue(calls("y", "z"))]
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(wire.batches) == MAX_IN_FLIGHT, "a batch went out over the in-flight limit"
    wire.release(0)
    await settle(wire, MAX_IN_FLIGHT + 1)
    assert wire.batches[-1] == ["x", "y", "z"]
    for n in range(1, MAX_IN_FLIGHT + 1):
        wire.release(n)
    assert await asyncio.gather(*waiting) == [["x"], ["y", "z"]]
    assert await asyncio.gather(*first) == [[f"k{n}"] for n in range(MAX_IN_FLIGHT)]


async def test_a_failed_batch_fails_its_callers_only() -> None:
    wire = Wire(gated=True)
    batcher = Batcher(wire.send)
    doomed = [batcher.queue(calls("a")), batcher.queue(calls("b"))]
    await settle(wire, 1)
    fine = batcher.queue(calls("c"))
    await settle(wire, 2)
    wire.fail = ConnectionError("master gone")
    wire.release(0)
    for future in doomed:
        with pytest.raises(ConnectionError, match="master gone"):
            await future
    wire.fail = None
    wire.release(1)
    assert await fine == ["c"]
    wire.gated = False
    assert await batcher.queue(calls("d")) == ["d"]


async def test_a_caller_that_gives_up_leaves_the_others_their_replies() -> None:
    wire = Wire(gated=True)
    batcher = Batcher(wire.send)
    gone, kept = batcher.queue(calls("a")), batcher.queue(calls("b", "c"))
    await settle(wire, 1)
    gone.cancel()
    wire.release(0)
    assert await kept == ["b", "c"]
    assert gone.cancelled()


class Node:
    def __init__(self, name: str) -> None:
        self.name = name


class Cluster:
    """A stand-in for RedisCluster: the master of a counter is its key's first letter
    ("a7" -> master "a"); each master's wire answers as the fixed-window script does
    (the count before the hit), fails, or holds its calls until released."""

    def __init__(self) -> None:
        self.nodes = {name: Node(name) for name in "abc"}
        self.counters: dict[str, int] = {}
        self.sends: list[tuple[str, list[str]]] = []
        self.failing: set[str] = set()
        self.stalled: dict[str, asyncio.Event] = {}

    def get_node_from_key(self, key: str) -> Node:
        return self.nodes[key.partition("{")[2][0]]

    def get_node(self, node_name: str) -> Node | None:
        return self.nodes.get(node_name)

    async def initialize(self) -> None:
        return None

    async def send_node(self, cluster: Cluster, node: Node | None, batch: list[Call],
                        timeout_s: float) -> list[object]:
        assert node is not None
        keys = [str(args[0]).partition("{")[2].partition("}")[0] for _, args in batch]
        self.sends.append((node.name, keys))
        if node.name in self.stalled:
            await self.stalled[node.name].wait()
        if node.name in self.failing:
            return [ConnectionError(f"master {node.name} down")] * len(batch)
        replies: list[object] = []
        for (_, args), key in zip(batch, keys, strict=True):
            replies.append(self.counters.get(key, 0))
            self.counters[key] = self.counters.get(key, 0) + int(args[1])
        return replies


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Cluster:
    fake = Cluster()
    monkeypatch.setattr(redis_store, "send_node", fake.send_node)
    return fake


def store_on(cluster: Cluster) -> RedisStore:
    return RedisStore(cluster, timeout_s=1.0)  # type: ignore[arg-type]


def hits(*keys: str, addend: int = 1) -> list[Hit]:
    return [Hit(key, Algorithm.FIXED_WINDOW, 100, 60, addend) for key in keys]


async def test_each_master_batches_its_own_calls_and_replies_land_in_order(
        cluster: Cluster) -> None:
    store = store_on(cluster)
    first = hits("a1", "b1", "a2", "c1", "b2")
    second = hits("c1", "a1")
    counts = await asyncio.gather(store.hit(first, T), store.hit_each(second, T),
                                  store.hit(hits("b1"), T))
    assert [[c.used for c in answers if isinstance(c, Count)] for answers in counts] == [
        [1, 1, 1, 1, 1], [2, 2], [2]]
    # One batch per master for the three requests, each in request order.
    assert sorted(cluster.sends) == [("a", ["a1", "a2", "a1"]), ("b", ["b1", "b2", "b1"]),
                                     ("c", ["c1", "c1"])]


async def test_a_failed_masters_calls_fail_alone(cluster: Cluster) -> None:
    store = store_on(cluster)
    cluster.failing.add("b")
    answers = await store.hit_each(hits("a1", "b1", "c1", "b2"), T)
    assert [a.used if isinstance(a, Count) else str(a) for a in answers] == [
        1, "master b down", 1, "master b down"]
    with pytest.raises(ConnectionError, match="master b down"):
        await store.hit(hits("a1", "b1"), T)
    assert cluster.counters == {"a1": 2, "c1": 1}


async def test_a_stalled_master_holds_up_no_other_masters_calls(cluster: Cluster) -> None:
    store = store_on(cluster)
    cluster.stalled["a"] = asyncio.Event()
    stuck = []
    for n in range(MAX_IN_FLIGHT + 1):  # more than may be in flight to "a"
        stuck.append(asyncio.create_task(store.hit(hits(f"a{n}"), T)))
        for _ in range(5):
            await asyncio.sleep(0)
    spread = asyncio.create_task(store.hit(hits("b1", "a9"), T))
    elsewhere = asyncio.create_task(store.hit(hits("b1", "c1"), T))
    done, _ = await asyncio.wait([elsewhere, spread, *stuck],
                                 return_when=asyncio.FIRST_COMPLETED)
    assert done == {elsewhere}
    cluster.stalled["a"].set()
    assert [c.used for c in await spread] == [1, 1]
    assert [(await s)[0].used for s in stuck] == [1] * (MAX_IN_FLIGHT + 1)
    assert [c.used for c in elsewhere.result()] == [2, 1]


async def test_a_request_cancelled_midway_leaves_the_others_their_replies(
        cluster: Cluster) -> None:
    store = store_on(cluster)
    cluster.stalled["a"] = asyncio.Event()
    cluster.failing.add("c")
    gone = asyncio.create_task(store.hit_each(hits("a1", "b1", "c1"), T))
    kept = asyncio.create_task(store.hit_each(hits("a2", "b2", "c2"), T))
    for _ in range(10):
        await asyncio.sleep(0)
    gone.cancel()
    cluster.stalled["a"].set()
    answers = await kept
    assert [a.used if isinstance(a, Count) else str(a) for a in answers] == [
        1, 1, "master c down"]
    assert gone.cancelled()
