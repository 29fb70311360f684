"""One request's token figures on its latency chain: each streaming stage's stream, the
request's time to first token, and which stage that time went to.

The attribution rule (pure, no clock):

- The request's *entry* is its earliest hop (the longest one on a tie): what the client
  waited on. The *source* is the streaming stage whose hop started last: the innermost
  stream, where tokens are made; the stages around it only relay them.
- The request's TTFT runs from the entry hop's start to the first token seen there (the
  entry's own stream, when the entry is observed), else to the source's first token.
  Its ITL is the entry's stream's (what the client saw), else the source's.
- That TTFT window is split over the stages with the rule the chain uses for end to end
  (`own_times`): every hop is clipped to the window, and a stage owns its clipped span
  minus the clipped hops nested in it. So a guard before the LLM owns the time until
  the LLM's hop began, and the LLM owns the rest: its own TTFT plus the relay of the
  first token back out, which is the LLM's doing as far as the chain can tell.
- Over many requests, the owner of TTFT in the slowest 1 % is the stage with the largest
  summed share over those requests (sitsmesh.chains.tokenjoin).
- A stall is the innermost stage's that had it: every stage around the one that stopped
  sees the same gap relayed, so a stall that overlaps (by more than half) a stall of a
  stage whose hop started later is dropped from the outer stage's list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from sitsmesh.chains.assembler import Hop, own_times
from sitsmesh.tokens.timing import StreamSummary


@dataclass(frozen=True, slots=True)
class StageStream:
    """One stage's token stream of one request, in ms from the stage's hop start."""

    stage: str
    ttft_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tokens: int
    tokens_per_s: float
    # (after ms, length ms), at most MAX_STALLS: those this stage made (see the rule)
    stalls: tuple[tuple[float, float], ...]
    stall_count: int
    end: str


@dataclass(frozen=True, slots=True)
class RequestTokens:
    request_id: str
    trace_id: str
    ttft_s: float | None       # None: no stage saw a first token
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_s: float
    source: str                # the stage that made the tokens
    shares: Mapping[str, float]  # stage -> seconds of the request's TTFT
    streams: tuple[StageStream, ...]  # in the order of `order`, streaming stages only
    start: float = 0.0         # the entry hop's start (absolute seconds)
    # each streaming stage's hop (start, end), absolute seconds: for its trace span
    stage_spans: Mapping[str, tuple[float, float]] | None = None

    @property
    def longest_stall(self) -> tuple[str, float, float] | None:
        """(stage, after ms, length ms) of the longest stall, if any."""
        stalls = [(s.stage, after, length) for s in self.streams for after, length in s.stalls]
        return max(stalls, key=lambda s: s[2]) if stalls else None


def stage_stream(stage: str, summary: StreamSummary) -> StageStream:
    return StageStream(stage, _ms(summary.ttft_s), _ms(summary.itl_p50_s),
                       _ms(summary.itl_p99_s), summary.tokens, round(summary.tokens_per_s, 3),
                       tuple((_ms0(s.after_s), _ms0(s.length_s)) for s in summary.stalls),
                       summary.stall_count, summary.end.value)


def request_tokens(request_id: str, trace_id: str, hops: Mapping[str, Hop],
                   streams: Mapping[str, StreamSummary], e2e_s: float, *,
                   order: tuple[str, ...]) -> RequestTokens | None:
    """The request's token figures; None when none of its hops streamed. `order`: the
    pipeline's stage names, the order the streams are listed in."""
    streamed = [name for name in order if name in streams and name in hops]
    if not streamed or not hops:
        return None
    entry_name, entry = min(hops.items(), key=lambda kv: (kv[1].start, -kv[1].duration))
    source = max(streamed, key=lambda name: (hops[name].start, -hops[name].duration))
    seen = streams.get(entry_name)
    if seen is None or seen.ttft_s is None:
        seen = streams[source]
        first = (None if seen.ttft_s is None
                 else hops[source].start + seen.ttft_s - entry.start)
    else:
        first = seen.ttft_s
    shares = ttft_shares(hops, entry.start, entry.start + first) if first is not None else {}
    starts = {name: hops[name].start for name in streamed}
    return RequestTokens(
        request_id, trace_id, first, seen.itl_p50_s, seen.itl_p99_s, e2e_s, source, shares,
        own_stalls([stage_stream(name, streams[name]) for name in streamed], starts),
        entry.start, {name: (hops[name].start, hops[name].end) for name in streamed})


def own_stalls(streams: list[StageStream], starts: Mapping[str, float]
               ) -> tuple[StageStream, ...]:
    """The streams with each stall left only at the innermost stage that had it."""
    if not any(s.stalls for s in streams):
        return tuple(streams)  # the common case
    def absolute(stream: StageStream) -> list[tuple[float, float]]:
        base = starts[stream.stage] * 1000
        return [(base + after, base + after + length) for after, length in stream.stalls]

    inner = {s.stage: absolute(s) for s in streams}
    out = []
    for stream in streams:
        later = [span for other in streams if starts[other.stage] > starts[stream.stage]
                 for span in inner[other.stage]]
        kept = tuple(stall for stall, (begin, end) in zip(stream.stalls, inner[stream.stage],
                                                          strict=True)
                     if not any(min(end, e) - max(begin, b) > (end - begin) / 2
                                for b, e in later))
        out.append(stream if len(kept) == len(stream.stalls)
                   else dataclasses.replace(stream, stalls=kept))
    return tuple(out)


def ttft_shares(hops: Mapping[str, Hop], start: float, first: float) -> dict[str, float]:
    """Each stage's part of [start, first]: hops clipped to it, nested ones subtracted."""
    if first <= start:
        return {}
    clipped = {}
    for name, hop in hops.items():
        begin, end = max(hop.start, start), min(hop.end, first)
        if end > begin:
            clipped[name] = Hop(hop.request_id, begin, end - begin)
    own, _ = own_times(clipped) if clipped else ({}, 0.0)
    return {name: seconds for name, seconds in own.items() if seconds > 0}


def owner(shares: Mapping[str, float]) -> str:
    """The stage with the largest share ("" for none); ties go to the first named."""
    best, most = "", 0.0
    for name, seconds in shares.items():
        if seconds > most:
            best, most = name, seconds
    return best


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def _ms0(seconds: float) -> float:
    return round(seconds * 1000, 3)
