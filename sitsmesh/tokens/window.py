"""Finished token streams per pipeline stage over the last minutes, for the latency chain
report: the same 10 s slots as the chain assembler's, so both cover one window."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sitsmesh.chains.histogram import Histogram
from sitsmesh.tokens.timing import StreamSummary

SLOT_S = 10
SLOTS = 30


@dataclass(slots=True)
class _Tally:
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    streams: int = 0
    tokens: int = 0
    stalls: int = 0


@dataclass(frozen=True, slots=True)
class TokenStageReport:
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    streams: int
    tokens: int
    stalls: int


class TokenWindows:
    """`add` each finished stream of a (pipeline, stage); `report` a pipeline's stages
    over a window. Memory: SLOTS x the stages that streamed, whatever the traffic."""

    __slots__ = ("_clock", "_slots")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # slot index -> (pipeline, stage) -> tally; the ring is SLOTS long
        self._slots: dict[int, dict[tuple[str, str], _Tally]] = {}

    def add(self, pipeline: str, stage: str, summary: StreamSummary) -> None:
        index = int(self._clock() // SLOT_S)
        slot = self._slots.get(index)
        if slot is None:
            slot = self._slots[index] = {}
            for old in [i for i in self._slots if i <= index - SLOTS]:
                del self._slots[old]
        tally = slot.get((pipeline, stage))
        if tally is None:
            tally = slot[pipeline, stage] = _Tally()
        tally.streams += 1
        tally.tokens += summary.tokens
        tally.stalls += summary.stall_count
        if summary.ttft_s is not None:
            tally.ttft.add(summary.ttft_s)
        if summary.itl_p50_s is not None:
            tally.tpot.add(summary.itl_p50_s)

    def report(self, pipeline: str, window_s: int) -> dict[str, TokenStageReport]:
        """Per stage of `pipeline` that had finished streams in the window."""
        newest = int(self._clock() // SLOT_S)
        oldest = newest - max(1, window_s // SLOT_S) + 1
        merged: dict[str, _Tally] = {}
        for index, slot in self._slots.items():
            if not oldest <= index <= newest:
                continue
            for (name, stage), tally in slot.items():
                if name != pipeline:
                    continue
                into = merged.setdefault(stage, _Tally())
                into.ttft.merge(tally.ttft)
                into.tpot.merge(tally.tpot)
                into.streams += tally.streams
                into.tokens += tally.tokens
                into.stalls += tally.stalls
        return {stage: TokenStageReport(_ms(t.ttft, 0.5), _ms(t.ttft, 0.99),
                                        _ms(t.tpot, 0.5), _ms(t.tpot, 0.99),
                                        t.streams, t.tokens, t.stalls)
                for stage, t in merged.items()}


def _ms(hist: Histogram, q: float) -> float | None:
    return round(hist.quantile(q) * 1000, 3) if hist.total else None
