"""Per-pipeline and per-stage signals: plain counters the request path bumps, no locks.

Writers (Check, ShouldRateLimit, access logs, Envoy's stats, the Triton scraper)
only add to counters and keep samples stamped with when they happened, plus how
late they arrived; the controller reads them once per tick. Times are this
process's monotonic seconds.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from sitsmesh.chains.histogram import Histogram
from sitsmesh.pressure.estimate import BIN_S
from sitsmesh.pressure.thresholds import PRIORITIES

SAMPLES = 512     # recent log delays kept per pipeline and per stage
HOPS = 4096       # recent hops kept per stage (a few seconds at thousands per second)


class PipelineSignals:
    """Arrivals at a pipeline's entry, by priority, and what is in flight inside it."""

    __slots__ = ("admit_bins", "admitted", "arrivals", "by_priority", "ended", "in_flight",
                 "journal", "lags", "open_bins", "rl_arrivals", "shed")

    def __init__(self) -> None:
        self.arrivals = 0
        # Seen by ShouldRateLimit: the same stream when both filters run, so the
        # controller takes the larger of the two rates.
        self.rl_arrivals = 0
        self.admitted = 0
        self.shed = 0
        self.by_priority = [0] * PRIORITIES
        # Admitted and not yet seen to end (the access log ends them), in total and by
        # admission time: the controller weighs the open ones by how likely they still run.
        self.in_flight = 0
        self.open_bins: dict[int, int] = {}
        self.admit_bins: dict[int, int] = {}   # every hold, by admission bin (pruned)
        self.ended: deque[tuple[float, float]] = deque(maxlen=HOPS)  # (admitted, ended)
        self.lags: deque[float] = deque(maxlen=SAMPLES)       # ended -> its log arrived
        # With shared runtime state: every hold and its end, in order, for the replica's
        # next report to the others (None: not shared, nothing kept).
        self.journal: list[tuple[float, float | None, float | None]] | None = None

    def arrive(self, priority: int) -> None:
        self.arrivals += 1
        self.by_priority[priority if 0 <= priority < PRIORITIES else 0] += 1

    def hold(self, admitted: float) -> None:
        if self.journal is not None:
            self.journal.append((admitted, None, None))
        self.in_flight += 1
        index = int(admitted // BIN_S)
        self.open_bins[index] = self.open_bins.get(index, 0) + 1
        self.admit_bins[index] = self.admit_bins.get(index, 0) + 1

    def unhold(self, admitted: float, ended: float | None, arrived: float,
               held_at: float | None = None) -> None:
        """A held request ended at `ended` (None: its hold timed out), learned at `arrived`.
        `held_at`: the time its hold was recorded at, when that is not `admitted` (a
        replica's hold arrives binned): the hold is found in that bin."""
        if self.journal is not None:
            self.journal.append((admitted, ended, arrived))
        if self.in_flight > 0:
            self.in_flight -= 1
        index = int((admitted if held_at is None else held_at) // BIN_S)
        left = self.open_bins.get(index, 0) - 1
        if left > 0:
            self.open_bins[index] = left
        else:
            self.open_bins.pop(index, None)
        if ended is not None:
            self.lags.append(max(0.0, arrived - ended))
            self.ended.append((admitted, ended))


@dataclass(slots=True)
class TritonSample:
    """One scrape of one model: cumulative counters and the pending gauge, with its time."""

    at: float
    pending: int
    success: float
    failure: float
    queue_us: float
    request_us: float = 0.0  # queue and compute: the service time is the difference


@dataclass(slots=True)
class EnvoySample:
    """One Envoy's stats for one cluster at one flush: gauges, and cumulative counters."""

    at: float              # when Envoy took it (its own timestamp)
    active: float          # requests sent upstream and not answered yet
    pending: float         # waiting in Envoy for a connection
    completed: float = 0.0
    errors: float = 0.0    # 5xx, timeouts, resets, overflow


@dataclass(slots=True)
class OwnerWork:
    """With chains partitioned over replicas, one owner's latest sums of a stage's work
    over the requests it owns (sitsmesh.pressure.work), in place of their hops."""

    bins: dict[int, list[float]]  # wall-clock bins
    received: float     # when they came (monotonic here)
    until: float        # every end before this had reached their owner (monotonic here)
    lag: float          # the owner's longest recent log delay
    newest: float | None  # the newest hop end among them (monotonic here)
    shift: float        # wall clock less monotonic here, when they came
    # No hop came to the owner since its report before: it reports again once one does
    # (or with its full report each second) and does not hold the watermark back.
    quiet: bool = False


class StageSignals:
    """The stage's hops (from access logs, stamped with their own times), its queue as
    Triton or Envoy see it, and how late each kind of signal arrives."""

    __slots__ = ("completions", "envoy", "expects_triton", "hops", "lags", "last_arrival",
                 "latency", "merged", "owners", "triton")

    def __init__(self) -> None:
        # Set when the stage names a Triton model that is scraped: until a sample comes
        # (and whenever the last one is old) the stage counts as saturated.
        self.expects_triton = False
        self.completions = 0
        self.last_arrival = 0.0         # when the last hop's entry came in
        self.latency = Histogram()      # swapped out by the controller every tick
        # (request id, start, end, failed) of recent hops
        self.hops: deque[tuple[str, float, float, bool]] = deque(maxlen=HOPS)
        self.lags: deque[float] = deque(maxlen=SAMPLES)
        self.triton: list[TritonSample] = []  # the last two scrapes
        self.envoy: dict[str, EnvoySample] = {}  # per reporting Envoy, its latest sample
        self.owners: dict[str, OwnerWork] = {}  # per partition owner (shared runtime)
        self.merged: dict[int, list[float]] = {}  # their bins added up, kept as they change

    def complete(self, request_id: str, started: float, seconds: float, *, failed: bool,
                 arrived: float) -> None:
        """A hop that started at `started` (monotonic) and took `seconds`, reported at
        `arrived`."""
        self.completions += 1
        self.last_arrival = arrived
        self.latency.add(seconds)
        ended = started + seconds
        self.hops.append((request_id, started, ended, failed))
        self.lags.append(max(0.0, arrived - ended))

    def lag(self) -> float:
        """How late hop entries come lately: the watermark is this far behind now."""
        lag = max(self.lags, default=0.0)
        for owner in self.owners.values():
            lag = max(lag, owner.lag)
        return lag

    def newest(self) -> float | None:
        """The newest hop end known (None before the first)."""
        if self.hops:
            # Entries come in roughly in order of their ends: the last few hold the newest.
            return max(hop[2] for hop in itertools.islice(reversed(self.hops), 64))
        return max((o.newest for o in self.owners.values() if o.newest is not None),
                   default=None)

    def scraped(self, sample: TritonSample) -> None:
        self.triton = [*self.triton[-1:], sample]


@dataclass(slots=True)
class Signals:
    """Everything the controller reads, keyed by pipeline and (pipeline, stage)."""

    pipelines: dict[str, PipelineSignals] = field(default_factory=dict)
    stages: dict[tuple[str, str], StageSignals] = field(default_factory=dict)

    def pipeline(self, name: str) -> PipelineSignals:
        found = self.pipelines.get(name)
        if found is None:
            found = self.pipelines[name] = PipelineSignals()
        return found

    def stage(self, pipeline: str, stage: str) -> StageSignals:
        key = (pipeline, stage)
        found = self.stages.get(key)
        if found is None:
            found = self.stages[key] = StageSignals()
        return found
