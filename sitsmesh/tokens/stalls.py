"""Each pipeline stage's stall threshold: the gap between two tokens past which its
stream counts as stalled. A stage's `stall_ms` sets it; unset, it is learned from the
stage's own inter-token latency, so a slow engine's normal pace is not a stall and a
fast engine's second-long pause is one.

The rule, per stage: MULTIPLE x the median of its last RECENT streams' ITL p99, clamped
to [FLOOR_S, CEILING_S]; DEFAULT_S until MIN_STREAMS streams have been seen.
- A stream's p99 already holds the engine's normal hiccups (other requests' prefill
  joining the batch); a gap several times it is one the engine does not make at work.
- The median over streams, not the p99 over every gap: a stream with a stall has that
  stall as its p99 when it is short, and a stage must stall in half its streams before
  stalls look normal. RECENT streams follow the engine when it changes (a model swap).
- FLOOR_S: a reader does not see a gap under a quarter second (4-5 tokens/s is reading
  pace), a busy host's scheduling alone makes 100 ms gaps, and an engine that sends
  several tokens per event has event gaps that many times its per-token ITL.
- CEILING_S: a gap of 5 s is a stall for any interactive client whatever the engine's
  pace, and it stays far under Envoy's stream_idle_timeout (60 s), past which Envoy
  cuts the stream instead of letting the gap end.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from sitsmesh.tokens.stages import StageIndex
from sitsmesh.tokens.timing import StreamSummary

DEFAULT_S = 1.0
MULTIPLE = 4.0
FLOOR_S = 0.25
CEILING_S = 5.0
MIN_STREAMS = 20
RECENT = 64


def learned_stall_s(itl_p99s: list[float] | deque[float]) -> float:
    """The threshold the rule gives for these streams' ITL p99s (at least MIN_STREAMS)."""
    return min(CEILING_S, max(FLOOR_S, MULTIPLE * median(itl_p99s)))


class StallThresholds:
    """`stall_of(cluster, route)` when a stream's response headers arrive; `learn` each
    finished stream of a stage. Memory: RECENT floats per stage that streamed, and only
    for stages the pipelines still have."""

    __slots__ = ("_default_s", "_learned", "_names", "_recent", "_stages")

    def __init__(self, stages: StageIndex, default_s: float = DEFAULT_S) -> None:
        self._stages = stages
        self._default_s = default_s
        self._recent: dict[tuple[str, str], deque[float]] = {}
        self._learned: dict[tuple[str, str], float] = {}
        self._names = stages.names

    def stall_of(self, cluster: str, route: str) -> float:
        key = self._stages.stage_of(cluster, route)
        configured = self._stages.configured_stall_s(key)
        if configured is not None:
            return configured
        return self._learned.get(key, self._default_s)

    def learn(self, pipeline: str, stage: str, summary: StreamSummary) -> None:
        key = (pipeline, stage)
        stages = self._stages
        if stages.names is not self._names:  # pipelines changed: forget removed stages
            self._names = names = stages.names
            for gone in [k for k in self._recent if k not in names]:
                del self._recent[gone]
                self._learned.pop(gone, None)
        itl_p99 = summary.itl_p99_s
        if itl_p99 is None or stages.configured_stall_s(key) is not None:
            return
        recent = self._recent.get(key)
        if recent is None:
            if not stages.has(pipeline, stage):
                return
            recent = self._recent[key] = deque(maxlen=RECENT)
        recent.append(itl_p99)
        if len(recent) >= MIN_STREAMS:
            self._learned[key] = learned_stall_s(recent)
