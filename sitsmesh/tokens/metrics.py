"""Prometheus series of finished token streams, under the OpenTelemetry GenAI semantic
conventions' names where one exists (gen_ai.server.time_to_first_token and
gen_ai.server.time_per_output_token, in their Prometheus form)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from sitsmesh.chains.ttft import RequestTokens
from sitsmesh.tokens.stages import UNKNOWN
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End

LABELS = ("pipeline", "stage", "format")
UNTRACKED = ("not_streaming", "streams", "bytes", "unreadable")
# The GenAI conventions' advisory buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class TokenMetrics:
    """`observe` takes each finished stream's report."""

    __slots__ = ("_bad", "_chain_itl", "_chain_ttft", "_ends", "_parts", "_stalls",
                 "_tokens", "_tpot", "_ttft", "_unjoined", "_untracked")

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                               "Time from the request to its first content token, per "
                               "token stream.", LABELS, registry=registry,
                               buckets=TTFT_BUCKETS)
        self._tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                               "Inter-token latency: the median gap between output tokens "
                               "after the first, per token stream.", LABELS,
                               registry=registry, buckets=TPOT_BUCKETS)
        self._tokens = Counter("sitsmesh_output_tokens_total",
                               "Output tokens of finished token streams (the stream's usage "
                               "where it reported one, else its content events).",
                               LABELS, registry=registry)
        self._ends = Counter("sitsmesh_token_streams_total",
                             "Finished token streams, by how they ended.", [*LABELS, "end"],
                             registry=registry)
        self._stalls = Counter("sitsmesh_token_stalls_total",
                               "Gaps between tokens longer than the stall threshold.",
                               LABELS, registry=registry)
        self._bad = Counter("sitsmesh_token_events_unreadable_total",
                            "Events of token streams that their format could not read, or "
                            "over the event size bound.", LABELS, registry=registry)
        # Per request, over its latency chain (sitsmesh.chains.ttft has the rule).
        self._chain_ttft = Histogram(
            "sitsmesh_chain_time_to_first_token_seconds",
            "Time to first token per request, from its entry hop's start to the first "
            "token seen at the entry.", ["pipeline"], registry=registry,
            buckets=TTFT_BUCKETS)
        self._chain_itl = Histogram(
            "sitsmesh_chain_time_per_output_token_seconds",
            "Inter-token latency per request (its median gap), as its entry saw it.",
            ["pipeline"], registry=registry, buckets=TPOT_BUCKETS)
        self._parts = Counter(
            "sitsmesh_chain_time_to_first_token_part_seconds_total",
            "Each stage's part of its requests' time to first token.",
            ["pipeline", "stage"], registry=registry)
        self._unjoined = Counter(
            "sitsmesh_token_reports_unjoined_total",
            "Token stream reports dropped before their request's chain came: expired, or "
            "pushed out by the bound on waiting reports.", ["reason"], registry=registry)
        for reason in ("expired", "max_pending"):
            self._unjoined.labels(reason)
        self._untracked = Counter("sitsmesh_token_streams_untracked_total",
                                  "Responses seen by the ext_proc filter and not timed: "
                                  "not a token stream (not_streaming), or past the bound "
                                  "on streams parsed at once (streams) or on the bytes "
                                  "their unfinished events keep (bytes); and access-log "
                                  "entries whose token timing from Envoy's filter could "
                                  "not be read (unreadable).", ["reason"],
                                  registry=registry)
        for end in End:  # every series exists from the start, at 0
            self._ends.labels(*UNKNOWN, "openai", end.value)
        for reason in UNTRACKED:
            self._untracked.labels(reason)

    def untracked(self, reason: str) -> None:
        self._untracked.labels(reason).inc()

    def observe(self, report: TokenReport, stage: tuple[str, str]) -> None:
        """`stage`: the (pipeline, stage) the stream belongs to."""
        labels, summary = (*stage, report.format), report.summary
        if summary.ttft_s is not None:
            self._ttft.labels(*labels).observe(summary.ttft_s)
        if summary.itl_p50_s is not None:
            self._tpot.labels(*labels).observe(summary.itl_p50_s)
        self._tokens.labels(*labels).inc(summary.tokens)
        self._ends.labels(*labels, summary.end.value).inc()
        if summary.stall_count:
            self._stalls.labels(*labels).inc(summary.stall_count)
        if report.bad_events:
            self._bad.labels(*labels).inc(report.bad_events)

    def chain(self, pipeline: str, figures: RequestTokens) -> None:
        """A request joined to its streams (sitsmesh.chains.tokenjoin's listener)."""
        if figures.ttft_s is not None:
            self._chain_ttft.labels(pipeline).observe(figures.ttft_s)
        if figures.itl_p50_s is not None:
            self._chain_itl.labels(pipeline).observe(figures.itl_p50_s)
        for stage, seconds in figures.shares.items():
            self._parts.labels(pipeline, stage).inc(seconds)

    def unjoined(self, reason: str) -> None:
        self._unjoined.labels(reason).inc()
