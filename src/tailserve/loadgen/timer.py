"""A one-shot timer finer than the event loop's own.

uvloop's timers count whole milliseconds (and asyncio's wait in epoll, whose timeout does
too), so a timer set for a request due in 0.3 ms fires up to a millisecond late, and a
generator that waits on them sends Poisson arrivals in millisecond clumps, both of which
the server under test is then blamed for: at 7,500 req/s the last of a clump of 15 waits
for the other 14. On Linux a ``timerfd`` armed at an absolute time on the monotonic clock
(the clock of ``time.monotonic``) becomes readable within microseconds of it, and the loop
wakes for a readable descriptor at once, whatever its own timers' resolution.

`PreciseTimer` is that timer, armed through libc with ctypes; where there is no timerfd
(not Linux, no libc), `LoopTimer` falls back to the loop's own timers. Either calls
``callback`` once per `at`, from the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import os
import time
from collections.abc import Callable
from typing import Protocol

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = 0o4000
TFD_CLOEXEC = 0o2000000
TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Timer(Protocol):
    # Requests due within this of one another may go together (see the runner's `fire`).
    resolution: float

    def at(self, when: float) -> None:
        """Call back once at ``when`` (a `time.monotonic()` value), replacing any earlier
        setting; at once if it has passed."""

    def close(self) -> None: ...


class LoopTimer:
    """The loop's own timers: a millisecond's resolution under uvloop."""

    resolution = 1e-3

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None

    def at(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_later(max(0.0, when - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._callback()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class PreciseTimer:
    """A timerfd on the monotonic clock, watched by the loop."""

    # Finer than the loop can use: each wake-up costs it a few microseconds.
    resolution = 250e-6

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        callback: Callable[[], None],
        libc: ctypes.CDLL,
    ) -> None:
        self._loop = loop
        self._callback = callback
        self._settime = libc.timerfd_settime
        fd = libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._fd: int | None = fd
        self._spec = _Itimerspec()
        self._value = self._spec.it_value
        self._ref = ctypes.byref(self._spec)
        loop.add_reader(fd, self._fire)

    def fileno(self) -> int:
        """Its timerfd (-1 once closed, as a socket's)."""
        return -1 if self._fd is None else self._fd

    def at(self, when: float) -> None:
        if self._fd is None:
            raise RuntimeError("the timer is closed")
        seconds = int(when)
        nanoseconds = int((when - seconds) * 1e9)
        if seconds <= 0 and nanoseconds <= 0:
            nanoseconds = 1  # zero would disarm it
        self._value.tv_sec = seconds
        self._value.tv_nsec = nanoseconds
        if self._settime(self._fd, TFD_TIMER_ABSTIME, self._ref, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _fire(self) -> None:
        if self._fd is None:
            return
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return  # re-armed since it became readable: the new time has not come
        self._callback()

    def close(self) -> None:
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "timerfd_create"):
        return None
    libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.timerfd_settime.argtypes = [
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_Itimerspec),
        ctypes.c_void_p,
    ]
    return libc


def fine_timer_available() -> bool:
    return _libc() is not None


def timer(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], None], *, fine: bool = True
) -> Timer:
    """The finest timer this platform offers (a timerfd where there is one, else the loop's);
    the loop's if not ``fine``."""
    libc = _libc() if fine else None
    if libc is not None:
        try:
            return PreciseTimer(loop, callback, libc)
        except OSError:
            pass
    return LoopTimer(loop, callback)
