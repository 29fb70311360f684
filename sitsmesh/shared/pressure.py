"""One backpressure controller for every replica, fed by all of them.

Each replica's gate counts the traffic it sees (arrivals by priority, admissions,
sheds, and every admission hold with its end) in its own signals. Every tick it
reports what changed on the hop bus; every replica applies every report to the
signals its controller reads, so all controllers see the whole fleet. The one
holding the lease publishes its decision (fenced by its token); the others run
theirs as a hot standby, unpublished, and apply the published one. A gate takes
its replica's share of what a decision counts in requests (the in-flight cap, the
admission budget, the in-flight offset), in proportion to the arrivals it saw.
Times cross replicas as wall-clock seconds, each replica converting with its own
monotonic offset.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from sitsmesh import logs
from sitsmesh.chains.histogram import BUCKETS, Histogram
from sitsmesh.pressure import work
from sitsmesh.pressure.controller import Decision, Snapshot
from sitsmesh.pressure.estimate import BIN_S
from sitsmesh.pressure.runtime import PressureRuntime
from sitsmesh.pressure.signals import EnvoySample, OwnerWork, PipelineSignals
from sitsmesh.pressure.stages import WINDOW_S, SignalAge, StagePressure
from sitsmesh.pressure.thresholds import PRIORITIES
from sitsmesh.shared.hopbus import HopBus
from sitsmesh.shared.lease import Lease

DECISION_TTL_MS = 2_000   # a decision nobody renews stops applying within two seconds
SHARE_ALPHA = 0.2          # smoothing of this replica's share of the arrivals
WORK_SLACK_S = 0.25        # stage work sent for this much more than the window
# Stage work sent at most this often (the tick is 50 ms): what every replica decodes
# is each owner's few seconds of bins, so sent every tick it was a fixed cost of about
# 2 µs per entry at 20,000 entries/s; the watermark waits the extra 0.05 s.
WORK_EVERY_S = 0.1
FULL_EVERY = 10
_log = logs.get("sitsmesh.shared.pressure")

_Counts = tuple[int, int, int, int, tuple[int, ...]]


def _counts(signals: PipelineSignals) -> _Counts:
    return (signals.arrivals, signals.rl_arrivals, signals.admitted, signals.shed,
            tuple(signals.by_priority))


# --- the decision on the wire ------------------------------------------------------


def encode_snapshot(snapshot: Snapshot, wall_offset: float) -> str:
    """JSON, times in wall-clock seconds."""
    decisions = {}
    for name, decision in snapshot.decisions.items():
        body = dataclasses.asdict(decision)
        body["at"] = decision.at + wall_offset
        decisions[name] = body
    return json.dumps({"at": snapshot.at + wall_offset, "decisions": decisions})


def decode_snapshot(raw: str | bytes, wall_offset: float) -> Snapshot:
    """The published decision in this process's monotonic time; ValueError if malformed."""
    try:
        data = json.loads(raw)
        decisions = {}
        for name, body in data["decisions"].items():
            stages = tuple(StagePressure(**{**stage, "signals": tuple(
                SignalAge(**age) for age in stage["signals"])}) for stage in body["stages"])
            decisions[name] = Decision(**{**body, "stages": stages,
                                          "at": float(body["at"]) - wall_offset,
                                          "priority_rates": tuple(
                                              float(r) for r in body.get("priority_rates", ()))})
        return Snapshot(decisions, float(data["at"]) - wall_offset)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"malformed decision: {exc}") from None


def share_of(snapshot: Snapshot, share: Mapping[str, float],
             caps: Mapping[str, int] | None = None) -> Snapshot:
    """What this replica's gate applies: the counts of each decision cut to its share;
    `caps`, this replica's part of each in-flight cap (else its share, rounded up)."""
    decisions = {}
    for name, d in snapshot.decisions.items():
        part = share.get(name, 1.0)
        cap = (caps or {}).get(name) or max(1, math.ceil(d.concurrency * part))
        decisions[name] = dataclasses.replace(
            d, concurrency=cap if d.concurrency else 0,
            admit_rate=d.admit_rate * part, in_flight_offset=round(d.in_flight_offset * part))
    return Snapshot(decisions, snapshot.at)


def cap_parts(cap: int, shares: Mapping[str, float]) -> dict[str, int]:
    """An in-flight cap cut in whole parts that add up to it (when it can give each
    replica one), by largest remainder, ties by name: every replica computes the same
    parts from the same reports. Each rounding its own share up gave two replicas 3 + 3
    of a cap of 5, and the bottleneck's queue and p99 stood higher."""
    whole = sum(shares.values())
    if cap <= 0 or whole <= 0:
        return {}
    exact = {r: cap * s / whole for r, s in shares.items()}
    parts = {r: max(1, math.floor(e)) for r, e in exact.items()}
    left = cap - sum(parts.values())
    for r in sorted(exact, key=lambda r: (math.floor(exact[r]) - exact[r], r))[:max(0, left)]:
        parts[r] += 1
    return parts


# --- the replicas' reports ----------------------------------------------------------


class SharedPressure:
    def __init__(self, runtime: PressureRuntime, bus: HopBus, client: Redis | RedisCluster,
                 lease: Lease) -> None:
        self._runtime = runtime
        self._bus = bus
        self._client = client
        self.lease = lease
        self._decision_key = lease.key("decision")  # fenced by the lease, in its slot
        self._sent: dict[str, _Counts] = {}
        self._local_arrivals: dict[str, float] = {}   # since the last share update
        self._all_arrivals: dict[str, float] = {}
        self.share: dict[str, float] = {}
        self.shares: dict[str, dict[str, float]] = {}  # pipeline -> replica -> share
        self._sender_arrivals: dict[str, dict[str, float]] = {}
        self.published = 0
        self.applied = 0
        self._owned_done: dict[tuple[str, str], int] = {}  # completions summed so far
        self._work_at = -math.inf
        self._work_reports = 0
        self._work_quiet = False  # the last work report said no hop came
        bus.on("p", self.apply_report)
        bus.on("e", self.apply_envoy)
        bus.on("w", self.apply_work)

    def envoy(self, node: str, samples: Mapping[str, EnvoySample]) -> None:
        """An Envoy's stats flush reached this replica: every replica's controller gets it
        (its times are Envoy's own, wall clock, already)."""
        self._bus.publish(["e", node, {cluster: [s.at, s.active, s.pending, s.completed,
                                                 s.errors]
                                       for cluster, s in samples.items()}])

    def apply_envoy(self, event: list[Any]) -> None:
        _, node, samples = event
        if not isinstance(node, str) or not isinstance(samples, dict):
            raise ValueError("an Envoy event is ['e', node, {cluster: sample}]")
        self._runtime.on_envoy(node, {str(cluster): EnvoySample(*(float(v) for v in values))
                                      for cluster, values in samples.items()})

    def report(self) -> None:
        """This replica's changes since its last report, onto the bus (no I/O here)."""
        offset = self._runtime.gate.wall_offset
        pipelines: dict[str, Any] = {}
        for name, signals in self._runtime.local.pipelines.items():
            now = _counts(signals)
            before = self._sent.get(name, (0, 0, 0, 0, (0,) * PRIORITIES))
            journal, signals.journal = signals.journal or [], []
            # The gate never reads these bins; only the report needed them.
            signals.admit_bins.clear()
            if now == before and not journal:
                continue
            self._sent[name] = now
            holds: dict[int, int] = {}
            ends = []
            for admitted, ended, arrived in journal:
                if arrived is None:
                    index = int((admitted + offset) // BIN_S)
                    holds[index] = holds.get(index, 0) + 1
                else:
                    ends.append([admitted + offset,
                                 None if ended is None else ended + offset, arrived + offset])
            pipelines[name] = [now[0] - before[0], now[1] - before[1], now[2] - before[2],
                               now[3] - before[3],
                               [a - b for a, b in zip(now[4], before[4], strict=True)],
                               [[i, n] for i, n in holds.items()], ends]
            self._local_arrivals[name] = self._local_arrivals.get(name, 0.0) + (
                now[0] - before[0])
        if pipelines:
            self._bus.publish(["p", pipelines, self.lease.holder])

    def apply_report(self, event: list[Any]) -> None:
        """A replica's report (this one's too) into the signals the controller reads."""
        if len(event) not in (2, 3) or not isinstance(event[1], dict):
            raise ValueError("a report is ['p', {pipeline: changes}, replica]")
        sender = str(event[2]) if len(event) == 3 else ""
        offset = self._runtime.gate.wall_offset
        signals = self._runtime.signals
        if any(isinstance(c, list) and len(c) == 7 and (c[2] or c[5])
               for c in event[1].values()):
            self._bus.holds_seen()  # admitted and held, wherever: its releases must go out
        for name, changes in event[1].items():
            if name not in self._runtime.local.pipelines:
                continue  # a pipeline this replica does not know (yet)
            arrivals, rl, admitted, shed, priorities, holds, ends = changes
            target = signals.pipeline(name)
            target.arrivals += int(arrivals)
            target.rl_arrivals += int(rl)
            target.admitted += int(admitted)
            target.shed += int(shed)
            for p, count in enumerate(priorities[:PRIORITIES]):
                target.by_priority[p] += int(count)
            for index, count in holds:
                at = (int(index) + 0.5) * BIN_S - offset
                for _ in range(int(count)):
                    target.hold(at)
            # An end is learned here now, not when its replica learned it: the watermark
            # ("every end up to here has arrived") must wait for the report too, or the
            # ends still on their way count as requests in flight.
            here = self._runtime.now()
            for adm, ended, _arrived in ends:
                # Its hold came binned (above): it is found in the same bin, else it
                # stayed open for good and counted as in flight from then on.
                held_at = (int(float(adm) // BIN_S) + 0.5) * BIN_S - offset
                target.unhold(float(adm) - offset,
                              None if ended is None else float(ended) - offset,
                              here, held_at)
            self._all_arrivals[name] = self._all_arrivals.get(name, 0.0) + int(arrivals)
            senders = self._sender_arrivals.setdefault(name, {})
            senders[sender] = senders.get(sender, 0.0) + int(arrivals)
        self.applied += 1

    def report_work(self) -> None:
        """The sums of this replica's part of every stage's recent work (the chains it
        owns, binned as their hops came) onto the bus, for every controller to add up
        (no I/O here). They cover the window the controllers read and then some; each
        report replaces the last."""
        runtime = self._runtime
        now = runtime.now()
        offset = runtime.gate.wall_offset
        # The bins changed since the last report; all of them every FULL_EVERY reports,
        # so a replica that joined (or missed one) is whole again within a second.
        full = self._work_reports % FULL_EVERY == 0
        self._work_reports += 1
        quiet = True  # no hop of any stage came since the last report
        pipelines: dict[str, Any] = {}
        for name, pipeline in runtime.pipelines.items():
            names = [stage.name for stage in pipeline.stages]
            owned = [runtime.owned.stage(name, stage) for stage in names]
            reach = max([0.0, *(s.lag() for s in owned),
                         *(runtime.signals.stage(name, stage).lag() for stage in names)])
            ledger = (runtime.ledgers or {}).get(name) or work.WorkLedger()
            since = now + offset - reach - WINDOW_S - WORK_SLACK_S
            stages: dict[str, Any] = {}
            for stage, signals in zip(names, owned, strict=True):
                done = signals.completions - self._owned_done.get((name, stage), 0)
                self._owned_done[name, stage] = signals.completions
                quiet = quiet and not done
                latency, signals.latency = signals.latency, Histogram()
                newest = signals.newest()
                taken = ledger.take(stage, since, now + offset, full=full)
                first, bins = taken if taken is not None else (-1, {})
                stages[stage] = [work.encode(bins), done,
                                 [[i, n] for i, n in enumerate(latency.counts) if n],
                                 round(signals.lag(), 6),
                                 None if newest is None else newest + offset,
                                 signals.last_arrival + offset if signals.completions else None,
                                 first, full]
            pipelines[name] = stages
        # Quiet now and at the last report, which told every reader so (a quiet owner
        # does not hold their watermark back): nothing to say until the full report.
        # An idle fleet of N sent N x 10 reports a second that woke every replica.
        if pipelines and (full or not (quiet and self._work_quiet)):
            self._bus.publish(["w", pipelines, self.lease.holder, now + offset])
        self._work_quiet = quiet

    def apply_work(self, event: list[Any]) -> None:
        """An owner's sums (this replica's too) into the signals the controller reads,
        in place of its last ones. All of it or, if any of it is malformed, none."""
        if len(event) != 4 or not isinstance(event[1], dict):
            raise ValueError("stage work is ['w', {pipeline: {stage: sums}}, replica, at]")
        _, pipelines, sender, sent = event
        runtime = self._runtime
        offset = runtime.gate.wall_offset
        now = runtime.now()
        found = []
        for name, stages in pipelines.items():
            pipeline = runtime.pipelines.get(name)
            if pipeline is None or not isinstance(stages, dict):
                continue  # a pipeline this replica does not know (yet)
            known = {stage.name for stage in pipeline.stages}
            for stage, record in stages.items():
                if stage not in known:
                    continue
                raw, done, buckets, lag, newest, last, first, full = record
                counts = [(int(i), int(n)) for i, n in buckets]
                if int(done) < 0 or float(lag) < 0 or any(
                        not 0 <= i < BUCKETS or n < 0 for i, n in counts):
                    raise ValueError("stage work counts are not negative, buckets in range")
                rows = work.decode(raw)
                if not isinstance(first, int) or not isinstance(full, bool) or (
                        rows and min(rows) < first):
                    raise ValueError("stage work from bin `first` on, `full` true or false")
                found.append((runtime.signals.stage(name, stage), int(done), counts, first,
                              rows, full, float(sent) - offset - float(lag), float(lag),
                              None if newest is None else float(newest) - offset,
                              None if last is None else float(last) - offset))
        quiet = not any(record[1] for record in found)  # no hop came to it since
        for signals, done, counts, first, rows, full, until, lag, newest, last in found:
            owner = signals.owners.get(str(sender))
            if owner is None:
                owner = signals.owners[str(sender)] = OwnerWork({}, now, until, lag, newest,
                                                                offset)
            if first >= 0:
                work.replace_from(owner.bins, signals.merged, first, rows, whole=full)
            owner.received, owner.until, owner.lag, owner.shift = now, until, lag, offset
            owner.newest, owner.quiet = newest, quiet
            signals.completions += done
            for i, n in counts:
                signals.latency.counts[i] += n
                signals.latency.total += n
            if last is not None:
                signals.last_arrival = max(signals.last_arrival, last)

    def _update_share(self) -> None:
        for name, total in self._all_arrivals.items():
            if total <= 0:
                continue
            part = min(1.0, self._local_arrivals.get(name, 0.0) / total)
            before = self.share.get(name, part)
            self.share[name] = before + SHARE_ALPHA * (part - before)
            # Every replica's share too, as every replica sees it: the cap's parts.
            shares = self.shares.setdefault(name, {})
            counts = self._sender_arrivals.get(name, {})
            for sender in set(shares) | set(counts):
                got = counts.get(sender, 0.0) / total
                was = shares.get(sender, got)
                shares[sender] = was + SHARE_ALPHA * (got - was)
                if shares[sender] < 0.001:
                    del shares[sender]  # a replica gone quiet (or gone)
        self._local_arrivals.clear()
        self._all_arrivals.clear()
        self._sender_arrivals.clear()

    def caps(self, snapshot: Snapshot) -> dict[str, int]:
        """This replica's part of each decision's in-flight cap, such that the parts of
        all replicas add up to the cap (see cap_parts)."""
        return {name: cap_parts(d.concurrency, self.shares.get(name, {})).get(
                    self.lease.holder, max(1, math.ceil(d.concurrency
                                                        * self.share.get(name, 1.0))))
                for name, d in snapshot.decisions.items() if d.concurrency}

    async def tick(self) -> Snapshot | None:
        """Report, decide (every replica: a hot standby), and publish or follow."""
        runtime = self._runtime
        self.report()
        if runtime.now() - self._work_at >= WORK_EVERY_S:
            self._work_at = runtime.now()
            self.report_work()
        self._update_share()
        mine = runtime.decide()
        offset = runtime.gate.wall_offset
        live: Snapshot | None = None
        try:
            if self.lease.leading and await self.lease.publish(
                    self._decision_key, encode_snapshot(mine, offset), DECISION_TTL_MS):
                live = mine
                self.published += 1
            else:
                raw = await self._client.get(self._decision_key)
                live = decode_snapshot(raw, offset) if raw is not None else None
        except ValueError as exc:
            _log.warning("published decision unreadable; deciding alone", error=str(exc))
        except Exception as exc:  # Redis down: keep going on this replica's own decision
            _log.warning("shared decision unavailable; deciding alone", error=str(exc))
            live = mine
        if live is None:
            # No leader for a moment (a failover, or its decision lapsed): the standby's
            # own decision, on the same signals, keeps shedding going meanwhile.
            live = mine
        runtime.apply(live, self._own_offsets(share_of(live, self.share, self.caps(live))))
        return live

    def _own_offsets(self, snapshot: Snapshot) -> Snapshot:
        """Each decision's in-flight offset from this replica's own live holds. The
        decision's offset is the fleet's, as of the last reports: scaled to a share it
        missed every hold and end since, and at 1 s access-log flush that drift alone
        tripped the in-flight cap in the calm (6 % false sheds). What this gate holds
        that most likely ended is known here, now; the fleet's estimate of what still
        runs, cut to this replica's share, stays a floor."""
        runtime = self._runtime
        now = runtime.now()
        decisions = {}
        for name, d in snapshot.decisions.items():
            local = runtime.local.pipelines.get(name)
            if local is None or not d.concurrency:
                decisions[name] = d
                continue
            part = self.share.get(name, 1.0)
            expected = max(runtime.controller.expected_in_flight(name, local, now),
                           d.in_flight * part)
            decisions[name] = dataclasses.replace(
                d, in_flight_offset=max(0, round(local.in_flight - expected)))
        return Snapshot(decisions, snapshot.at)

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self._runtime.tick_seconds())
