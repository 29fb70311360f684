"""The in-flight byte budget's pure parts: sizing from the cgroup, counting, the large-work
share. Through a real server: tests/security/test_limits_memory.py and test_soak_hostile.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sitsmesh.config import load_settings
from sitsmesh.errors import ConfigError
from sitsmesh.transport.budget import (
    FALLBACK_BYTES,
    LARGE_BURST_S,
    ByteBudget,
    LoopLag,
    default_capacity,
    memory_limit,
)


def test_memory_limit_reads_cgroup_v2_then_v1(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert memory_limit((v2, v1)) is None  # no cgroup files
    v1.write_text("536870912\n")
    assert memory_limit((v2, v1)) == 512 << 20
    v2.write_text("max\n")
    assert memory_limit((v2, v1)) is None  # v2 says unlimited: v1 is not read
    v2.write_text("268435456\n")
    assert memory_limit((v2, v1)) == 256 << 20
    v2.unlink()
    v1.write_text("9223372036854771712\n")  # v1's "unlimited"
    assert memory_limit((v2, v1)) is None


def test_capacity_is_an_eighth_of_the_limit_with_a_fallback() -> None:
    assert default_capacity(512 << 20) == 64 << 20
    assert default_capacity(None) == FALLBACK_BYTES
    assert default_capacity(8 << 20) == 4 << 20  # never below 4 MiB


def test_take_refuses_past_capacity_and_give_makes_room() -> None:
    budget = ByteBudget(100)
    assert budget.take(60)
    assert not budget.take(41)
    assert budget.take(40)
    assert budget.held == 100 and budget.refused == 1
    budget.give(60)
    assert budget.take(50)
    assert budget.peak == 100 and budget.held == 90


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _idle(lag: LoopLag, clock: Clock, seconds: float) -> None:
    """An idle loop: a tick on time every 20 ms."""
    for _ in range(round(seconds / 0.02)):
        clock.now += 0.02
        lag.tick()


def test_large_work_gets_its_share_of_the_loop() -> None:
    clock = Clock()
    lag = LoopLag(0.05, clock)
    lag._task = object()  # type: ignore[assignment]  # no ticker: ticks are called here
    _idle(lag, clock, 0.1)
    assert not lag.behind()
    lag.spent(0.3)  # one slow 1 MiB body
    assert lag.behind()
    _idle(lag, clock, 1.0)  # a tenth of a second's credit back per second
    assert lag.behind()
    _idle(lag, clock, 2.5)
    assert not lag.behind()
    lag.spent(LARGE_BURST_S / 2)
    assert not lag.behind()


def test_a_late_or_overdue_tick_means_behind() -> None:
    clock = Clock()
    lag = LoopLag(0.05, clock)
    lag._task = object()  # type: ignore[assignment]
    clock.now += 0.02
    lag.tick()
    assert not lag.behind()
    clock.now += 0.1  # the next tick is 80 ms overdue: the loop is busy
    assert lag.behind()
    lag.tick()  # it ran 80 ms late
    assert lag.behind()
    clock.now += 0.02
    lag.tick()
    assert not lag.behind()


@pytest.mark.parametrize(("raw", "value"), [("0", 0), ("8388608", 8 << 20)])
def test_inflight_budget_setting(raw: str, value: int) -> None:
    settings = load_settings({"inflight_budget_bytes": raw}, env={})
    assert settings.inflight_budget_bytes == value


def test_a_bad_inflight_budget_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--inflight-budget-bytes: must be between "
                                          r"4194304 and .* \(or 0: from the memory limit\)"):
        load_settings({"inflight_budget_bytes": "1000"}, env={})
    with pytest.raises(ConfigError, match="--large-message-lag-ms"):
        load_settings({"large_message_lag_ms": "0"}, env={})


async def test_a_hold_waits_for_room_in_its_half_and_is_refused_when_the_wait_runs_out(
) -> None:
    import asyncio

    budget = ByteBudget(100)
    assert budget.take(30)
    waiter = asyncio.ensure_future(budget.hold(30, 5.0))  # 30 + 30 > the hold part, 50
    await asyncio.sleep(0.05)
    assert not waiter.done() and budget.refused == 0  # waiting is not a refusal
    budget.give(30)
    assert await asyncio.wait_for(waiter, 1.0) and budget.held == 30
    assert not await budget.hold(30, 0.05)
    assert budget.refused == 1 and budget.held == 30
    # Holds never take the room a message that has come needs: large ones still fit.
    assert budget.take(45, large=True) and budget.held == 75


async def test_a_streams_first_read_holds_room_only_until_its_message_or_the_hold_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An open stream that sends nothing gives its room back after FIRST_HOLD_S, so idle
    streams cannot keep the new ones out; its message, when it comes, is still taken."""
    import asyncio
    from collections.abc import AsyncIterator

    from sitsmesh.transport import budgetwrap

    monkeypatch.setattr(budgetwrap, "FIRST_HOLD_S", 0.1)
    budget = ByteBudget(56 << 20)  # hold part 28 MiB: room for seven 4 MiB holds
    sent: list[asyncio.Event] = [asyncio.Event() for _ in range(10)]

    async def stream(gate: asyncio.Event) -> AsyncIterator[bytes]:
        await gate.wait()
        yield b"m" * 100

    async def first(i: int) -> bytes:
        metered = budgetwrap._Metered(stream(sent[i]), bytes, budget, None, 4 << 20,
                                       loop_share=True)
        message: bytes = await metered.__anext__()
        metered.close()
        return message

    readers = [asyncio.ensure_future(first(i)) for i in range(10)]
    await asyncio.sleep(0.05)
    assert budget.held == 7 * (4 << 20)  # seven hold room; three wait for it
    await asyncio.sleep(0.4)
    assert budget.held < 7 * (4 << 20)  # the holds ended though nothing was sent
    for gate in sent:
        gate.set()
    assert await asyncio.wait_for(asyncio.gather(*readers), 2.0) == [b"m" * 100] * 10
    assert budget.held == 0 and budget.refused == 0


@pytest.mark.parametrize("loop_share", [True, False])
async def test_a_stream_of_large_messages_waits_for_the_loop_only_where_it_shares_it(
        loop_share: bool) -> None:
    """Paced (the data port): after a large message, the next read waits while large
    work has used its share of the loop. Unpaced (the RLQS process, whose loop serves
    nothing else): it reads on, its bytes still charged."""
    import asyncio
    from collections.abc import AsyncIterator

    from sitsmesh.transport import budgetwrap
    from sitsmesh.transport.budget import LARGE_BYTES

    budget = ByteBudget(64 << 20)
    budget.lag.spent(60.0)  # large work far over its share: behind for a minute

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"r" * (LARGE_BYTES + 1)

    metered = budgetwrap._Metered(stream(), bytes, budget, None, 1 << 20,
                                   loop_share=loop_share)
    await metered.__anext__()
    assert budget.held > LARGE_BYTES  # charged, paced or not
    second = asyncio.ensure_future(metered.__anext__())
    done, _ = await asyncio.wait((second,), timeout=0.3)
    assert bool(done) is not loop_share
    second.cancel()
    metered.close()
    await budget.lag.stop()
