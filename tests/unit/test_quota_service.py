"""QuotaService: buckets reach rules of the rate-limit config and pipelines'
decisions; a global rate is split across every Envoy reporting buckets of one rule;
what moved is pushed. Pure logic: the real-Envoy proof is
tests/integration/test_rlqs_envoy.py."""

from __future__ import annotations

import dataclasses

import pytest

from sitsmesh.pressure.controller import Decision
from sitsmesh.quota.buckets import Kind
from sitsmesh.quota.service import MAX_BUCKETS, QuotaService, Stream, id_bytes
from sitsmesh.ratelimit.config import build

CONFIG = """
domain: edge
descriptors:
  - key: tenant
    value: acme
    rate_limit: {unit: minute, requests_per_unit: 600}
  - key: tenant
    value: free
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: tenant
    value: vip
    rate_limit: {unlimited: true}
"""
SHED = Decision("infer", "sitsmesh", 0.5, 2.5, 0, 9, 1, "model", "overloaded", 100.0, (), 0.0,
                priority_rates=(10.0,) * 10)


class World:
    def __init__(self) -> None:
        self.now = 0.0
        self.decisions: dict[str, Decision] = {}
        config = build([("edge.yaml", CONFIG)])
        self.service = QuotaService(lambda: config.domains, lambda: self.decisions,
                                    lambda _h, model, _t: "infer" if model == "llama" else "",
                                    clock=lambda: self.now, timer=lambda: 0.0)


def _bucket(tenant: str, priority: str = "0", model: str = "other") -> dict[str, str]:
    return {"name": "sitsmesh", "tenant": tenant, "priority": priority, "model": model}


def test_buckets_get_their_rules_verdict() -> None:
    world = World()
    stream = world.service.open()
    updates = dict((b["tenant"], a) for b, a in world.service.report(stream, "edge", [
        (_bucket("acme"), 1, 0, 0.0), (_bucket("free"), 1, 0, 0.0),
        (_bucket("vip"), 1, 0, 0.0), (_bucket("nobody"), 1, 0, 0.0)]))
    assert updates["free"] is not None and updates["free"].kind is Kind.DENY
    assert updates["vip"] is not None and updates["vip"].kind is Kind.ALLOW
    assert updates["nobody"] is not None and updates["nobody"].kind is Kind.ALLOW
    acme = updates["acme"]
    assert acme is not None and acme.kind is Kind.SHARED and acme.share is not None
    assert acme.share.rate == 10.0  # 600 a minute, one Envoy


def test_buckets_of_one_rule_share_its_rate_across_envoys_and_priorities() -> None:
    world = World()
    a, b = world.service.open(), world.service.open()
    world.service.report(a, "edge", [(_bucket("acme", "0"), 90, 0, 0.0),
                                     (_bucket("acme", "5"), 90, 0, 0.0)])
    world.service.report(b, "edge", [(_bucket("acme"), 10, 0, 0.0)])
    world.now = 5.0
    # Demand: a's two buckets 18/s each, b's 2/s.
    got = world.service.report(a, "edge", [(_bucket("acme", "0"), 90, 0, 5.0),
                                           (_bucket("acme", "5"), 90, 0, 5.0)])
    got += world.service.report(b, "edge", [(_bucket("acme"), 10, 0, 5.0)])
    world.service.refresh()
    rates = [bk.due.share.rate for s in (a, b) for bk in s.buckets.values()
             if bk.due is not None and bk.due.share is not None]
    assert sum(rates) == 10.0
    assert rates[2] < rates[0] / 5  # b asks for 2 of 38 requests/s


def test_a_pipeline_decision_denies_shed_priorities_and_splits_the_cut_one() -> None:
    world = World()
    stream = world.service.open()
    world.service.report(stream, "edge", [(_bucket("vip", str(p), "llama"), 1, 0, 0.0)
                                          for p in (0, 2, 5)])
    world.decisions["infer"] = SHED  # level 2.5: 0-1 shed, half of 2, protected from 9
    pushes = world.service.refresh()[stream.name]
    kinds = {b["priority"]: a.kind for b, a in pushes if a is not None}
    assert kinds == {"0": Kind.DENY, "2": Kind.SHARED}  # 5 stays ALLOW: nothing to push
    [half] = [a for b, a in pushes if b["priority"] == "2" and a is not None]
    assert half.share is not None and half.share.rate == 5.0  # half of its 10/s
    world.decisions["infer"] = dataclasses.replace(SHED, cutoff=0.0)
    again = world.service.refresh()[stream.name]
    assert {a.kind for _, a in again if a is not None} == {Kind.ALLOW}


def test_the_stricter_of_rule_and_pipeline_wins() -> None:
    world = World()
    stream = world.service.open()
    world.decisions["infer"] = SHED
    [(_, free_hi)] = world.service.report(stream, "edge", [(_bucket("free", "5", "llama"),
                                                             1, 0, 0.0)])
    assert free_hi is not None and free_hi.kind is Kind.DENY  # the rule denies
    [(_, acme_lo)] = world.service.report(stream, "edge", [(_bucket("acme", "0", "llama"),
                                                             1, 0, 0.0)])
    assert acme_lo is not None and acme_lo.kind is Kind.DENY  # the pipeline sheds it


def test_small_moves_are_not_pushed_and_replies_repeat_what_envoy_has() -> None:
    world = World()
    a, b = world.service.open(), world.service.open()
    world.service.report(a, "edge", [(_bucket("acme"), 50, 0, 5.0)])
    world.service.report(b, "edge", [(_bucket("acme"), 50, 0, 5.0)])
    world.service.refresh()
    first = next(iter(a.buckets.values())).sent
    world.now = 5.0
    [(_, reply)] = world.service.report(a, "edge", [(_bucket("acme"), 52, 0, 5.0)])
    assert reply == first  # a 4 % move: Envoy keeps its bucket (a new one starts full)
    assert world.service.refresh() == {}


def test_bad_and_too_many_buckets_are_abandoned_not_kept() -> None:
    world = World()
    stream = world.service.open()
    [(_, verdict)] = world.service.report(stream, "edge", [({"tenant": "x" * 300}, 1, 0, 0)])
    assert verdict is None and not stream.buckets
    usages = [(_bucket(f"t{i}"), 1, 0, 0.0) for i in range(MAX_BUCKETS + 5)]
    updates = world.service.report(stream, "edge", usages)
    assert len(stream.buckets) == MAX_BUCKETS
    assert sum(a is None for _, a in updates) == 5


def test_idle_buckets_are_abandoned_and_closed_streams_forgotten() -> None:
    world = World()
    a, b = world.service.open(), world.service.open()
    world.service.report(a, "edge", [(_bucket("acme"), 1, 0, 0.0)])
    world.service.report(b, "edge", [(_bucket("acme"), 1, 0, 0.0)])
    world.now = 1000.0
    [(_, gone)] = world.service.report(a, "edge", [(_bucket("acme"), 0, 0, 5.0)])
    assert gone is None and not a.buckets
    world.service.close(a)
    world.service.refresh()
    [bucket] = b.buckets.values()
    assert bucket.due is not None and bucket.due.share is not None
    assert bucket.due.share.rate == 10.0  # b alone now


def test_the_cut_priority_gets_what_the_bottlenecks_budget_leaves() -> None:
    """As Check's budget: under the level, a priority still gets the admit rate the
    priorities over it leave; above twice the in-flight cap, the brake denies it."""
    world = World()
    stream = world.service.open()
    world.service.report(stream, "edge", [(_bucket("vip", "0", "llama"), 1, 0, 0.0)])
    rates = (60.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 30.0)
    world.decisions["infer"] = dataclasses.replace(
        SHED, cutoff=0.9, protected_from=9, admit_rate=50.0, priority_rates=rates,
        concurrency=5, in_flight=4.0)
    [(_, budget)] = world.service.refresh()[stream.name]
    assert budget is not None and budget.share is not None
    assert budget.share.rate == 20.0  # 50 the bottleneck takes, 30 of them priority 9
    world.decisions["infer"] = dataclasses.replace(world.decisions["infer"], in_flight=10.0)
    [(_, braked)] = world.service.refresh()[stream.name]
    assert braked is not None and braked.kind is Kind.DENY


def test_replicas_split_over_every_envoy_of_the_fleet() -> None:
    world = World()
    stream = world.service.open()
    world.service.report(stream, "edge", [(_bucket("acme"), 50, 0, 5.0)])
    [group] = world.service.local_members
    world.service.remote = {group: {"other:1\x1fenvoy-1": 10.0, "other:1\x1fenvoy-2": 30.0}}
    world.service.refresh()
    [bucket] = stream.buckets.values()
    assert bucket.due is not None and bucket.due.share is not None
    assert bucket.due.share.rate == 2.0  # its 10 of the 50 requests/s asked: 2 of 10/s


def test_the_shares_in_force_always_add_up_to_the_rate() -> None:
    """Found by bench/rlqs_envoy.py: each bucket resent only when its own share moved
    20 %, so the Envoys held shares of different passes (114 % of the rate in all).
    Shares of one rate now go out together."""
    import random

    world = World()
    a, b = world.service.open(), world.service.open()
    draw = random.Random(3)
    for step in range(200):
        world.now = step * 5.0
        stream = a if step % 2 else b
        demand = draw.uniform(1.0, 40.0)
        world.service.report(stream, "edge", [(_bucket("acme"), int(demand * 5), 0, 5.0)])
        world.service.refresh()
        sent = [bk.sent.share.rate for s in (a, b) for bk in s.buckets.values()
                if bk.sent is not None and bk.sent.share is not None]
        if len(sent) == 2:
            assert sum(sent) == pytest.approx(10.0, abs=0.11), (step, sent)


class CountingWorld(World):
    """A World that counts how often a bucket's pipeline is looked up: the old service
    looked up every bucket of every stream on each report and each refresh."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0
        config = build([("edge.yaml", CONFIG)])

        def pipeline_for(hint: str, model: str, tenant: str) -> str:
            self.lookups += 1
            return "infer" if model == "llama" else ""

        self.service = QuotaService(lambda: config.domains, lambda: self.decisions,
                                    pipeline_for, clock=lambda: self.now, timer=lambda: 0.0)


def _fleet(world: World, streams: int, per_stream: int) -> list[Stream]:
    opened = []
    for s in range(streams):
        stream = world.service.open()
        world.service.report(stream, "edge", [
            (_bucket(f"t{s}-{i}", str(i % 10), "llama" if i % 2 else "m"), 1, 0, 0.0)
            for i in range(per_stream)])
        opened.append(stream)
    while world.service.pending:
        world.service.refresh()
    return opened


def test_a_report_costs_what_it_touches_not_every_bucket_of_every_stream() -> None:
    """Issue 26: 30 streams of 1 000 buckets put Check's p50 at 683 ms, because every
    report and every 50 ms refresh recomputed all buckets. 100 x 1 000 buckets here:
    a report of 10 and the refresh after it visit O(10) buckets, and an idle refresh
    none."""
    world = CountingWorld()
    streams = _fleet(world, 100, 999)  # room for one more each
    lookups, visits = world.lookups, world.service.visits
    world.now = 5.0
    stream = streams[7]
    reported = [b.id for b in list(stream.buckets.values())[:10]]
    replies = world.service.report(stream, "edge", [(bid, 5, 0, 5.0) for bid in reported])
    assert len(replies) == 10
    world.service.refresh()
    assert world.lookups == lookups  # matched once, when each bucket arrived
    assert world.service.visits - visits <= 10
    before = world.service.visits
    assert world.service.refresh() == {}
    assert world.service.visits == before
    # A rate five streams share: a report moves their five shares, and nothing else.
    for each in streams[5:10]:
        world.service.report(each, "edge", [(_bucket("acme"), 1, 0, 0.0)])
    world.service.refresh()
    before = world.service.visits
    world.now = 10.0
    world.service.report(stream, "edge", [(_bucket("acme"), 400, 0, 5.0)])
    pushes = world.service.refresh()
    assert len(pushes) == 5  # every Envoy's share of acme's rate moved
    assert world.service.visits - before <= 2 * 5 + 1


def test_a_refresh_step_does_bounded_work_and_finishes_later() -> None:
    """A config reload rematches every bucket, a step at a time: the loop serves
    Check between steps."""
    world = World()
    world.service = QuotaService(world.service._domains, lambda: world.decisions,
                                 lambda hint, model, tenant: "",
                                 clock=lambda: world.now, timer=lambda: 0.0,
                                 work_per_step=500)
    streams = _fleet(world, 4, 1_000)
    config = build([("edge.yaml", CONFIG.replace("600", "1200"))])
    world.service._domains = lambda: config.domains
    steps = 0
    while True:
        before = world.service.visits
        world.service.refresh()
        steps += 1
        assert world.service.visits - before <= 2 * 500 + 1_000  # step + its pushes
        if not world.service.pending:
            break
    assert steps >= 8
    acme = [b for s in streams for b in s.buckets.values() if b.id["tenant"] == "t0-0"]
    assert acme  # every bucket still has an assignment
    assert all(b.due is not None for s in streams for b in s.buckets.values())


def test_a_new_demand_reaches_the_other_envoys_shares_at_the_next_refresh() -> None:
    world = World()
    a, b = world.service.open(), world.service.open()
    world.service.report(a, "edge", [(_bucket("acme"), 1, 0, 0.0)])
    world.service.report(b, "edge", [(_bucket("acme"), 1, 0, 0.0)])
    world.service.refresh()
    world.now = 5.0
    world.service.report(a, "edge", [(_bucket("acme"), 450, 0, 5.0)])
    world.service.report(b, "edge", [(_bucket("acme"), 50, 0, 5.0)])
    pushes = world.service.refresh()
    assert set(pushes) == {a.name, b.name}
    [(_, to_b)] = pushes[b.name]
    assert to_b is not None and to_b.share is not None and to_b.share.rate < 2.5


def test_bucket_id_bytes_are_bounded_per_stream_and_across_streams() -> None:
    """Issue 26: ~25 MB per stream of long ids, past 512 MB at 17 streams."""
    world = World()
    world.service = QuotaService(world.service._domains, lambda: world.decisions,
                                 lambda hint, model, tenant: "",
                                 clock=lambda: world.now, timer=lambda: 0.0,
                                 max_stream_id_bytes=200_000, max_id_bytes=500_000)
    long_ids = [{f"k{e}": f"{s}-{i}-" + "v" * 250 for e in range(16)} for s in range(4)
                for i in range(1_000)]
    per_stream = [world.service.open() for _ in range(4)]
    for s, stream in enumerate(per_stream):
        world.service.report(stream, "edge", [(bid, 1, 0, 0.0)
                                              for bid in long_ids[s * 1_000:(s + 1) * 1_000]])
        assert stream.id_bytes <= 200_000
    assert world.service.id_bytes <= 500_000
    kept = sum(len(s.buckets) for s in per_stream)
    assert 0 < kept < 4_000
    assert world.service.refused_ids == 4_000 - kept
    assert world.service.id_bytes == sum(id_bytes(b.id) for s in per_stream
                                         for b in s.buckets.values())
    # A stream that ends gives its bytes back: a new stream may keep ids again.
    world.service.close(per_stream[0])
    fresh = world.service.open()
    [(_, got)] = world.service.report(fresh, "edge", [(_bucket("acme"), 1, 0, 0.0)])
    assert got is not None
    assert world.service.id_bytes == sum(s.id_bytes for s in world.service.streams.values())


def test_small_demand_drift_waits_for_the_resplit_and_a_large_one_does_not() -> None:
    """Every Envoy reports every bucket each 5 s: a rate is split again at once only when
    its members' demand moved 10 % of its total, else within RESPLIT_S."""
    from sitsmesh.quota.service import RESPLIT_S

    world = World()
    a, b = world.service.open(), world.service.open()
    for stream in (a, b):
        world.service.report(stream, "edge", [(_bucket("acme"), 50, 0, 5.0)])
    world.service.refresh()
    [bucket] = a.buckets.values()
    split_at = bucket.due
    world.now = 1.0
    world.service.report(a, "edge", [(_bucket("acme"), 53, 0, 5.0)])  # +3 % of the total
    world.service.refresh()
    assert bucket.due is split_at  # not split again yet
    world.now = 1.0 + RESPLIT_S
    world.service.refresh()
    assert bucket.due is not None and bucket.due != split_at  # split within RESPLIT_S
    world.now += 1.0
    resplit = bucket.due
    world.service.report(b, "edge", [(_bucket("acme"), 10, 0, 5.0)])  # -40 %: at once
    world.service.refresh()
    assert bucket.due is not None and bucket.due.share is not None
    assert resplit is not None and resplit.share is not None
    assert bucket.due.share.rate > resplit.share.rate
