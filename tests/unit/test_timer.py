"""The generator's timers: the fine one (a timerfd) fires once per setting, never before its
time, follows a new setting, and lets go of its descriptor; the loop's behaves the same."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import pytest

from tailserve.loadgen.timer import LoopTimer, PreciseTimer, Timer, fine_timer_available, timer
from tailserve.process.loops import run


def test_linux_has_the_fine_timer() -> None:
    # Where the benchmarks run; elsewhere the generator falls back to the loop's timers.
    assert fine_timer_available()


async def _fired(
    make: Callable[[asyncio.AbstractEventLoop, Callable[[], None]], Timer], settings: list[float]
) -> list[float]:
    """Set the timer to each offset in turn (seconds from now); when it fired, until a quiet
    0.2 s past the last setting's time."""
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    quiet = asyncio.Event()

    def callback() -> None:
        fired.append(time.monotonic())

    t = make(loop, callback)
    start = time.monotonic()
    for offset in settings:
        t.at(start + offset)
    loop.call_later(max(settings[-1], 0.0) + 0.2, quiet.set)
    await quiet.wait()
    t.close()
    return [f - start for f in fired]


def test_the_fine_timer_fires_once_and_never_before_its_time() -> None:
    fired = run(_fired(timer, [0.02]))
    assert len(fired) == 1
    assert fired[0] >= 0.02


def test_a_new_setting_replaces_the_earlier_one() -> None:
    # Set for 10 ms, then at once for 300 ms: it fires once, for the second.
    fired = run(_fired(timer, [0.01, 0.3]))
    assert len(fired) == 1
    assert fired[0] >= 0.3


def test_a_time_already_past_fires_at_once() -> None:
    fired = run(_fired(timer, [-1.0]))
    assert len(fired) == 1


def test_closing_lets_go_of_the_descriptor() -> None:
    async def main() -> int:
        t = timer(asyncio.get_running_loop(), lambda: None)
        assert isinstance(t, PreciseTimer)
        fd = t.fileno()
        assert fd >= 0
        t.close()
        assert t.fileno() == -1
        with pytest.raises(RuntimeError, match="closed"):
            t.at(time.monotonic())
        return fd

    fd = run(main())
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_loop_timer_when_not_fine() -> None:
    async def main() -> list[float]:
        made = timer(asyncio.get_running_loop(), lambda: None, fine=False)
        assert isinstance(made, LoopTimer)
        assert made.resolution > PreciseTimer.resolution
        made.close()
        return await _fired(LoopTimer, [0.01, 0.3])

    fired = run(main())
    assert len(fired) == 1
    assert fired[0] >= 0.299  # the loop's clock may run a little ahead of time.monotonic
