"""How every tailserve process runs: on uvloop where it is installed, and how it takes the
signals that stop it.

Every stop drains. SIGTERM or SIGINT (SIGHUP too, for `tailserve up`), once or repeated within
`STOP_GRACE_S` of the first, is one request to stop: stop accepting, answer what is in flight,
exit 0. A parent that passes a signal on (make, a shell, tini, systemd) delivers it twice within
milliseconds, so a repeat is no reason to give up on requests in flight. Only one of them later
than that, or SIGQUIT at any time (Ctrl-\\ at a terminal), forces the stop. `StopRequests`
decides; `StopSignals` takes the signals on the event loop and acts.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

# Long enough for a parent to pass a signal on however busy the machine, short enough that a
# person who presses Ctrl-C again after waiting means it.
STOP_GRACE_S = 5.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORCE_SIGNALS = (signal.SIGQUIT,)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a new uvloop (else asyncio) loop; return its result."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class Stop(enum.Enum):
    DRAIN = "drain"  # the request to stop: stop accepting, answer what is in flight, exit
    SAME = "same"  # the same request again, within the grace window: nothing more to do
    FORCE = "force"  # cut the drain short


class StopRequests:
    """The stop signals a process has had, and what each one asks (no clock of its own)."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        self.grace_s = grace_s
        self.first_at: float | None = None
        self.forced = False

    def signalled(self, now: float, forced: bool = False) -> Stop:
        """What a signal at ``now`` asks; ``forced``: a forcing signal (SIGQUIT)."""
        if self.forced:
            return Stop.FORCE
        if self.first_at is None:
            self.first_at = now
            self.forced = forced
            return Stop.FORCE if forced else Stop.DRAIN
        self.forced = forced or now - self.first_at > self.grace_s
        return Stop.FORCE if self.forced else Stop.SAME


class StopSignals:
    """A process's stop signals on its event loop: each is decided by `StopRequests`, logged,
    and handed to ``act`` (which acts on DRAIN and FORCE). ``forcing`` says in the log what a
    forced stop does."""

    def __init__(
        self,
        act: Callable[[Stop], None],
        *,
        signals: Iterable[signal.Signals] = STOP_SIGNALS,
        forcing: str = "cutting the drain short",
        requests: StopRequests | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.act = act
        self.signals = tuple(signals)
        self.forcing = forcing
        self.requests = requests or StopRequests()
        self.clock = clock
        self._installed: list[signal.Signals] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take the stop signals and SIGQUIT on ``loop``: on the main thread only, where
        signals are delivered (tests run servers in threads of their own)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = loop
        for sig in self.signals:
            loop.add_signal_handler(sig, self.received, sig.name, False)
            self._installed.append(sig)
        for sig in FORCE_SIGNALS:
            loop.add_signal_handler(sig, self.received, sig.name, True)
            self._installed.append(sig)

    def remove(self) -> None:
        """Give the signals back. Once a stop is under way, the stop signals are ignored from
        here on: a repeat that comes after the drain (passed on late) must not turn the exit
        status 0 into the signal's."""
        loop = self._loop
        stopping = self.requests.first_at is not None and not self.requests.forced
        for sig in self._installed:
            if loop is not None and not loop.is_closed():
                loop.remove_signal_handler(sig)
            if stopping and sig in self.signals:
                signal.signal(sig, signal.SIG_IGN)
        self._installed.clear()

    def received(self, what: str, forced: bool = False) -> Stop:
        """A signal named ``what`` (or a request by another name) arrived: decide, log, act."""
        now = self.clock()
        stop = self.requests.signalled(now, forced)
        first = self.requests.first_at
        since = 0.0 if first is None else now - first
        if stop is Stop.DRAIN:
            log.info(
                "%s: stopping (the same again within %.0f s is the same request; SIGQUIT forces)",
                what,
                self.requests.grace_s,
            )
        elif stop is Stop.SAME:
            log.info(
                "%s, %.3f s after the first: the same request to stop (within %.0f s)",
                what,
                since,
                self.requests.grace_s,
            )
        elif stop is Stop.FORCE:
            after = "" if forced else f" {since:.1f} s after the first"
            log.warning("%s%s: forcing the stop, %s", what, after, self.forcing)
        self.act(stop)
        return stop
