"""The daemon's loop paces its scheduling cycles from the end of the last one: a submission that
arrives after a quiet spell is planned at once (after the loop's shortest yield), submissions that
arrive while cycles run back to back wait out a gap of 3x the last cycle (at least 2 ms, at most
250 ms), so that a busy daemon plans them together and scheduling keeps to about a quarter of
the event loop's time.

The loop runs here on a clock of the test's own: what is checked is how long the loop asks to
wait, never how long anything took."""

from __future__ import annotations

import asyncio
import types

import pytest

import scheduler.daemon.scheduling as scheduling
from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon, ManualClock


@pytest.fixture
def paced(tmp_path, monkeypatch):
    """(the daemon's cycle, the fake perf_counter, the waits the loop asked for, its cycles)."""
    d = Daemon(DaemonConfig(), tmp_path / "home", clock=ManualClock())
    d.prepare()
    cycle = d.cycle
    now = [1000.0]
    waits: list[float] = []
    cycles: list[float] = []

    async def sleep(delay: float) -> None:
        waits.append(delay)
        now[0] += delay
        await asyncio.sleep(0)

    def run_once(waits_later: bool = False) -> int:
        cycles.append(now[0])
        now[0] += cycle.last_cycle_s  # the cycle took as long as the test says
        return 0

    monkeypatch.setattr(scheduling, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(scheduling, "asyncio", types.SimpleNamespace(
        sleep=sleep, wait_for=asyncio.wait_for, to_thread=asyncio.to_thread))
    monkeypatch.setattr(cycle, "run_once", run_once)
    yield cycle, now, waits, cycles
    d.engine.dispose()


async def _cycles(cycle, cycles: list, n: int) -> None:
    """Wake the loop and let it run until it has run `n` cycles in all."""
    cycle.wake()
    for _ in range(1000):
        if len(cycles) >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the loop ran {len(cycles)} cycles, not {n}")


def test_a_submission_after_a_quiet_spell_is_planned_without_waiting_out_a_gap_that_passed(paced):
    cycle, now, waits, cycles = paced

    async def go():
        running = True
        task = asyncio.create_task(cycle.loop(lambda: running))
        cycle.last_cycle_s = 0.004  # a 4 ms cycle: the next one 12 ms after it ended at the soonest

        await _cycles(cycle, cycles, 1)  # the daemon's first cycle
        assert waits == [scheduling.CYCLE_YIELD_S]

        # a burst: woken again as the cycle ends, the loop waits out 3x the last cycle
        waits.clear()
        await _cycles(cycle, cycles, 2)
        assert waits == [pytest.approx(0.012)]
        assert cycles[1] - (cycles[0] + 0.004) == pytest.approx(0.012)

        # a quiet second, then one submission: planned after the shortest yield, not 12 ms more
        now[0] += 1.0
        waits.clear()
        await _cycles(cycle, cycles, 3)
        assert waits == [scheduling.CYCLE_YIELD_S]

        # part of the gap has passed: only the rest of it is waited out
        cycle.last_cycle_s = 0.010
        await _cycles(cycle, cycles, 4)
        now[0] += 0.005
        waits.clear()
        await _cycles(cycle, cycles, 5)
        assert waits == [pytest.approx(0.025)]

        # a long cycle (a huge backlog): the gap is capped
        cycle.last_cycle_s = 0.2
        await _cycles(cycle, cycles, 6)
        waits.clear()
        await _cycles(cycle, cycles, 7)
        assert waits == [pytest.approx(scheduling.CYCLE_GAP_MAX_S)]

        running = False
        cycle.wake()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
