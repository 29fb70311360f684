"""Token streams per stage over a window: merged across slots, old slots dropped, other
pipelines kept apart."""

from __future__ import annotations

import pytest

from sitsmesh.tokens.timing import End, StreamSummary
from sitsmesh.tokens.window import SLOT_S, SLOTS, TokenWindows


def _summary(ttft: float, tpot: float, tokens: int = 10, stalls: int = 0) -> StreamSummary:
    return StreamSummary(ttft, tpot, tpot, tokens, 1 / tpot, (), stalls, End.COMPLETE)


def test_a_window_merges_its_slots_and_keeps_pipelines_apart() -> None:
    now = [1000.0]
    windows = TokenWindows(clock=lambda: now[0])
    for ttft in (0.1, 0.2, 0.3):
        windows.add("chat", "llm", _summary(ttft, 0.02))
    now[0] += SLOT_S  # the next slot
    windows.add("chat", "llm", _summary(0.4, 0.02, stalls=2))
    windows.add("chat", "guard", _summary(0.01, 0.005, tokens=1))
    windows.add("other", "llm", _summary(5.0, 1.0))
    report = windows.report("chat", 60)
    assert set(report) == {"llm", "guard"}
    llm = report["llm"]
    assert (llm.streams, llm.tokens, llm.stalls) == (4, 40, 2)
    assert llm.ttft_p50_ms == pytest.approx(200, rel=0.05)
    assert llm.ttft_p99_ms == pytest.approx(400, rel=0.05)
    assert llm.tpot_p50_ms == pytest.approx(20, rel=0.05)
    # Only the newest slot in a 10 s window.
    assert windows.report("chat", SLOT_S)["llm"].streams == 1


def test_old_slots_leave_the_window_and_memory() -> None:
    now = [0.0]
    windows = TokenWindows(clock=lambda: now[0])
    windows.add("chat", "llm", _summary(0.1, 0.02))
    now[0] += SLOT_S * SLOTS
    windows.add("chat", "llm", _summary(0.1, 0.02))
    assert windows.report("chat", 300)["llm"].streams == 1
    assert len(windows._slots) == 1
    assert windows.report("none", 60) == {}
