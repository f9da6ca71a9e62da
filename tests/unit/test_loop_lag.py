"""The event loop's lag and how busy its thread is, measured by one timer."""

from __future__ import annotations

import asyncio
import time

from tailserve.observability.loop_lag import LoopLag


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def measure() -> tuple[float, float, float]:
    lag = LoopLag()
    lag.start()
    try:
        for _ in range(25):  # 0.5 s of work in 20 ms slices: the loop's thread is saturated
            burn(0.020)
            await asyncio.sleep(0)
        busy, lagged = lag.busy, lag.lag_s
        await asyncio.sleep(0.5)  # then idle
        return busy, lagged, lag.busy
    finally:
        lag.stop()


def test_a_saturated_loop_reads_busy_and_late_and_an_idle_one_does_not() -> None:
    busy, lagged, idle = asyncio.run(measure())
    # (The share is of wall time: on a machine whose other processes take CPU, a busy loop's
    # thread gets less of it, and that is what it reads.)
    assert busy > 0.25
    assert lagged > 0.002  # ticks due every 5 ms fired up to 20 ms late
    assert idle < 0.5 * busy
