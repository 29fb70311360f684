"""Chains assembled in shares (by partition) and their tallies merged answer as one
process that assembled them all: the report, the slowest chains, the histograms."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.pipeline import pipeline_from
from sitsmesh.chains.slowest import Slowest
from sitsmesh.chains.tally import Tally, decode, encode
from sitsmesh.shared.partitions import owned, partition_of

DEMO = pipeline_from("demo", {"stages": [
    {"name": "pre", "match": {"upstream_cluster": "pre"}},
    {"name": "feat", "match": {"upstream_cluster": "feat"}},
    {"name": "model", "match": {"upstream_cluster": "model"}},
]})
OTHER = pipeline_from("other", {"stages": [
    {"name": "a", "match": {"route_name": "a"}},
    {"name": "b", "match": {"route_name": "b"}},
]})
PIPELINES = {"demo": DEMO, "other": OTHER}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _traffic(rng: random.Random, n: int) -> list[tuple[float, list[Hop]]]:
    """(time it arrives, its hops) per request; some chains never complete."""
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(20)
        rid = f"{rng.getrandbits(64):016x}-{i}"
        trace = f"{rng.getrandbits(128):032x}" if rng.random() < 0.5 else ""
        t0 = rng.uniform(0, 1000)
        outer, mid, inner = sorted((rng.lognormvariate(-3, 1) for _ in range(3)), reverse=True)
        if rng.random() < 0.7:
            hops = [Hop(rid, t0, outer, upstream_cluster="pre", trace_id=trace,
                        queue=rng.random() / 100 if rng.random() < 0.5 else None),
                    Hop(rid, t0 + (outer - mid) / 2, mid, upstream_cluster="feat",
                        failed=rng.random() < 0.05),
                    Hop(rid, t0 + (outer - inner) / 2, inner, ttfb=inner / 3,
                        upstream_cluster="model")]
        else:
            hops = [Hop(rid, t0, outer, route_name="a"), Hop(rid, t0, mid, route_name="b")]
        rng.shuffle(hops)
        if rng.random() < 0.05:
            hops.pop()  # never completes: expires as incomplete
        out.append((t, hops))
    return out


def _replay(traffic: list[tuple[float, list[Hop]]], assemblers: dict[str, Assembler],
            owner_of: dict[int, str], clock: Clock) -> None:
    start = clock.now
    for t, hops in traffic:
        clock.now = start + t
        for asm in assemblers.values():
            asm.expire()
        for hop in hops:
            assemblers[owner_of[partition_of(hop.request_id)]].add(hop)
    clock.now += 60  # everything left open expires into the newest slot
    for asm in assemblers.values():
        asm.expire()


def _shares(others: Iterable[Assembler], keep: int) -> object:
    """What a replica reads back from the others: their tallies through JSON."""
    published = json.dumps([[index, {name: encode(t) for name, t in pipes.items()}]
                            for asm in others for index, pipes in asm.tallies(0)])

    def read(pipeline: str, oldest: int, newest: int) -> list[tuple[int, Tally]]:
        return [(index, decode(pipes[pipeline], keep)) for index, pipes in json.loads(published)
                if oldest <= index <= newest and pipeline in pipes]
    return read


def _compare(seed: int, n: int, replicas: list[str], top_k: int = 64, slowest: int = 10) -> None:
    traffic = _traffic(random.Random(seed), n)
    clock = Clock()
    one = Assembler(PIPELINES, clock=clock, top_k=top_k, slowest=slowest)
    _replay(traffic, {"one": one}, {p: "one" for p in range(16)}, clock)
    clock = Clock()
    fleet = {r: Assembler(PIPELINES, clock=clock, top_k=top_k, slowest=slowest)
             for r in replicas}
    owner_of = {p: r for r in replicas for p in owned(r, replicas)}
    _replay(traffic, fleet, owner_of, clock)
    for replica, asm in fleet.items():
        asm.shares = _shares((a for r, a in fleet.items() if r != replica), slowest)  # type: ignore[assignment]
    if n >= 1000:  # not vacuous: every replica assembled a share, slow chains were kept
        assert all(a.tallies(0) for a in fleet.values())
        full = one.report("demo", 3600)
        assert full is not None and full.chains > n // 2 and full.slowest and full.incomplete
    for name in PIPELINES:
        for window in (60, 300, 3600):
            expected = one.report(name, window)
            assert expected is not None
            for asm in fleet.values():
                assert asm.report(name, window) == expected


@pytest.mark.parametrize("seed", range(4))
def test_two_replicas_shares_merged_report_as_one_process(seed: int) -> None:
    _compare(seed, 3000, ["sitsmesh-0", "sitsmesh-1"])


def test_three_replicas_and_small_heaps_where_the_merge_must_trim() -> None:
    # top_k 4 and 2 kept: each replica's heaps hold more than the merged slot may keep.
    _compare(99, 2000, ["a", "b", "c"], top_k=4, slowest=2)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 400),
       replicas=st.lists(st.text("abcdef", min_size=1, max_size=4), min_size=1, max_size=4,
                         unique=True))
def test_any_split_merges_to_the_one_process_report(seed: int, n: int,
                                                    replicas: list[str]) -> None:
    _compare(seed, n, replicas, top_k=8, slowest=3)


def test_a_tally_survives_json_and_malformed_ones_are_refused() -> None:
    tally = Tally(Slowest(3))
    assert encode(decode(json.loads(json.dumps(encode(tally))), 3)) == encode(tally)
    clock = Clock()
    asm = Assembler(PIPELINES, clock=clock, slowest=3)
    _replay(_traffic(random.Random(5), 300), {"x": asm}, {p: "x" for p in range(16)}, clock)
    for _, pipes in asm.tallies(0):
        for full in pipes.values():
            assert encode(decode(json.loads(json.dumps(encode(full))), 3)) == encode(full)
    for bad in (None, [], [1] * 10, [0, 0, 0, [0.0, 9999, 1], {}, {}, {}, {}, [], []],
                [-1, 0, 0, [0.0], {}, {}, {}, {}, [], []]):
        with pytest.raises((ValueError, TypeError)):
            decode(bad, 3)


def test_replicas_chains_alike_in_time_and_sequence_merge_without_comparing_chains() -> None:
    clock = Clock()
    a, b = (Assembler(PIPELINES, clock=clock) for _ in range(2))
    for asm, rid in ((a, "on-a"), (b, "on-b")):  # each one's first chain, equally slow
        asm.add(Hop(rid, 0.0, 0.05, route_name="a"))
        asm.add(Hop(rid, 0.0, 0.02, route_name="b"))
    a.shares = _shares([b], 10)  # type: ignore[assignment]
    report = a.report("other", 60)
    assert report is not None and report.chains == 2
    assert sorted(c.request_id for c in report.slowest) == ["on-a", "on-b"]
