"""How many admitted requests are still running, while their access-log entries may be
on the way: the held requests weighed by the recent latencies, the backlog since the
last end known for sure, and the freshest direct view of a stage's queue. The gate
subtracts the rest (the decision's in_flight_offset) before it meets the cap.
"""

from __future__ import annotations

from sitsmesh.pressure import estimate
from sitsmesh.pressure.signals import PipelineSignals
from sitsmesh.pressure.stages import PipelineState
from sitsmesh.pressure.thresholds import Thresholds

LATENCY_WINDOW_S = 5.0   # the end-to-end latencies that weigh held requests
ADMIT_BINS = 6000        # admission bins kept for the fluid backlog (a minute at 10 ms)


def still_running(state: PipelineState, signals: PipelineSignals, thresholds: Thresholds,
               now: float, watermark: float, *,
               views: list[tuple[float, float, str]]) -> float:
    """Admitted requests still running, with their access-log entries possibly on the way
    (every end up to `watermark` has arrived). `views`: (when, requests there, stage)
    from direct views of stages' queues, fresher than the watermark."""
    # The latency distribution of the last few seconds only: after an overload (or one
    # that another controller let run) the long latencies of then would keep counting
    # today's held requests as still running.
    recent = sorted(ended - admitted for admitted, ended in signals.ended
                    if ended >= watermark - LATENCY_WINDOW_S)
    expected = estimate.in_flight(signals.open_bins, now, watermark, recent)
    # The latencies are as old as the watermark: when a queue builds, they promise ends
    # that cannot have happened. Since the watermark, at most the bottleneck's capacity
    # worth of requests can have finished.
    rates = [own.mu / thresholds.stage(name).fanout for name, own in state.stages.items()
             if own.mu]
    if rates:
        # What was in flight at the watermark is known exactly; from there, every admission
        # since, drained at the bottleneck's capacity.
        at_watermark = estimate.present_at(watermark, signals.open_bins, signals.ended)
        expected = max(expected, estimate.backlog(watermark, at_watermark,
                                                  signals.admit_bins, now, min(rates)))
        # The same from each direct view, where it is newer: what the stage held then,
        # every admission since, drained at its capacity (a lower bound: the admissions
        # may not have reached it yet, but they will).
        fresh = []
        for at, present, name in views:
            own = state.stages.get(name)
            if watermark < at <= now and own is not None and own.mu:
                rate = own.mu / thresholds.stage(name).fanout
                fresh.append(estimate.backlog(at, present, signals.admit_bins, now, rate))
        if fresh:
            # The freshest view replaces the older estimates rather than raising them:
            # their errors only add, and under a tight cap an in-flight count read high
            # idles the stage as surely as one read low overfills it.
            expected = max(fresh)
    if len(signals.admit_bins) > ADMIT_BINS:
        oldest = int((now - ADMIT_BINS * estimate.BIN_S / 2) // estimate.BIN_S)
        for index in [i for i in signals.admit_bins if i < oldest]:
            del signals.admit_bins[index]
    return min(expected, float(signals.in_flight))
