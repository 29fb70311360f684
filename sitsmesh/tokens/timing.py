"""One token stream's timing: time to first token, inter-token latency, stalls, and how
it ended, from the times its events were seen.

Times are the observer's (monotonic seconds), taken as each chunk arrives: the first
content token, not the first byte, starts the clock for ITL (engines send headers, and
often an empty role delta, before generating). Memory per stream is bounded: past
MAX_GAPS the gaps kept are thinned to every other one, so long streams keep a uniform
sample for their quantiles.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass

MAX_GAPS = 1024
MAX_STALLS = 16


class End(enum.Enum):
    COMPLETE = "complete"              # the format's end ([DONE], done, or the body's end)
    CLIENT_ABORT = "client_abort"      # the downstream went away first
    UPSTREAM_RESET = "upstream_reset"  # the engine's connection ended the stream unfinished
    IDLE_TIMEOUT = "idle_timeout"      # no event for the idle bound
    ERROR = "error"                    # the engine sent an error event
    # The body stopped before its end and Envoy did not say why (its access-log entry,
    # with the same request id, has the response flags: DC downstream, UR upstream).
    CUT = "cut"


@dataclass(frozen=True, slots=True)
class Stall:
    after_s: float   # from the stream's start to the gap's start
    length_s: float


@dataclass(frozen=True, slots=True)
class StreamSummary:
    ttft_s: float | None        # None: no content token came
    itl_p50_s: float | None     # None: fewer than two content events
    itl_p99_s: float | None
    tokens: int
    tokens_per_s: float         # after the first token; 0 with fewer than two
    stalls: tuple[Stall, ...]
    stall_count: int            # every stall, also those past MAX_STALLS
    end: End
    # Tokens counted from the events (a token per content event and choice): `tokens`
    # is the stream's usage where it reported one. -1: not counted (a stage's report).
    counted: int = -1


class StreamClock:
    """Feed `tokens(n, at)` for every event that carries n >= 1 content tokens, then
    `summary(end, at)`. A gap longer than `stall_s` between two content events (or from
    the last one to the end) is a stall."""

    __slots__ = ("_first", "_gaps", "_last", "_seen", "_stalls", "_started", "_stride",
                 "stall_count", "stall_s", "tokens_seen")

    def __init__(self, started: float, stall_s: float) -> None:
        self._started = started
        self.stall_s = stall_s
        self._first: float | None = None
        self._last = started
        self._gaps = array("d")
        self._stride = 1  # keep every _stride-th gap (doubles each time the array fills)
        self._seen = 0
        self._stalls: list[Stall] = []
        self.stall_count = 0
        self.tokens_seen = 0

    def tokens(self, count: int, at: float) -> Stall | None:
        """Record an event of `count` tokens at `at`; the stall it ended, if any."""
        if count <= 0:
            return None
        stall = None
        if self._first is None:
            self._first = at
        else:
            gap = at - self._last
            stall = self._stall(gap)
            per_token = gap / count
            for _ in range(min(count, 16)):  # one gap per token, bounded per event
                self._keep(per_token)
        self._last = at
        self.tokens_seen += count
        return stall

    def untimed(self, count: int, at: float) -> None:
        """`count` more tokens had come by `at`, at times not known: counted, with no gap
        kept and no stall looked for (Envoy's timing filter past what it wrote down)."""
        if count <= 0:
            return
        if self._first is None:
            self._first = at
        self._last = max(self._last, at)
        self.tokens_seen += count

    def _stall(self, gap: float) -> Stall | None:
        if gap <= self.stall_s:
            return None
        stall = Stall(self._last - self._started, gap)
        self.stall_count += 1
        if len(self._stalls) < MAX_STALLS:
            self._stalls.append(stall)
        return stall

    def _keep(self, gap: float) -> None:
        self._seen += 1
        if self._seen % self._stride:
            return
        if len(self._gaps) >= MAX_GAPS:
            self._gaps = self._gaps[1::2]
            self._stride *= 2
            if self._seen % self._stride:
                return
        self._gaps.append(gap)

    def summary(self, end: End, at: float, tokens: int | None = None) -> StreamSummary:
        """`tokens`: the true output count where the stream reported one (usage)."""
        if self._first is not None and end is not End.COMPLETE:
            self._stall(at - self._last)  # a stream that stopped producing, then died
        first = self._first
        count = self.tokens_seen if tokens is None else tokens
        gaps = sorted(self._gaps)
        span = self._last - first if first is not None else 0.0
        return StreamSummary(
            ttft_s=None if first is None else first - self._started,
            itl_p50_s=_quantile(gaps, 0.50), itl_p99_s=_quantile(gaps, 0.99),
            tokens=count,
            tokens_per_s=(self.tokens_seen - 1) / span if span > 0 else 0.0,
            stalls=tuple(self._stalls), stall_count=self.stall_count, end=end,
            counted=self.tokens_seen)


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
