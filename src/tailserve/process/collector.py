"""Full garbage collections on the event loop's schedule, not the interpreter's.

CPython's cyclic collector runs a full collection, which walks every tracked object the worker
holds while it keeps the GIL, whenever the oldest generation has grown by a quarter since
the last one. The worker freezes what it loads (`gc.freeze`), but a result cache keeps growing
after that: the L1's ordered dicts (4.4 ms to walk 100,000 entries on an idle core) and the
reply memo's entries. Under load at 5,000 req/s a worker with L1 + Redis ran a full collection
every 3-4 s on average, each 2.5-46 ms, longer as the memo grew (up to 99 ms in the cache
benchmark): a stop of the event loop that every request in flight waits out, often enough that
a 5 s capacity step rarely escaped one.

`FullCollections` turns the automatic full collections off and runs one every ``every_s``
seconds from the event loop. Young collections stay automatic: they walk only what is new and
take well under a millisecond. A full collection costs what it did; it comes a tenth as often
or less, so most seconds of service see none. Cyclic garbage that reached the oldest generation
waits up to ``every_s`` to be freed (objects with no cycle are freed at once, as always).

The thresholds are the process's: with several workers in one process (the tests) the first
to start saves them and the last to stop puts them back.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A number of young collections no run reaches: the oldest generation is never collected on
# the interpreter's count.
_NEVER = 2**30

_lock = threading.Lock()  # workers in threads of one process start and stop on their own
_active = 0
_saved: tuple[int, int, int] | None = None


def freeze_held() -> None:
    """Collect once, then move everything the process holds now out of the collector's
    generations (`gc.freeze`): no later collection walks it. For what lives as long as the
    process, once it is set up (the worker's models, the router's dispatcher, a benchmark's
    plan); it is freed by reference counting as ever, only never walked."""
    gc.collect()
    gc.freeze()


class FullCollections:
    def __init__(self, every_s: float, *, on_pause: Callable[[float], None] | None = None):
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, not {every_s}")
        self.every_s = every_s
        self.on_pause = on_pause
        self.collections = 0
        self.last_pause_s = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        global _active, _saved
        if self._handle is not None:
            return
        with _lock:
            if _active == 0:
                _saved = gc.get_threshold()
                young, middle = _saved[0], _saved[1]
                gc.set_threshold(young, middle, _NEVER)
            _active += 1
        self._loop = loop
        self._handle = loop.call_later(self.every_s, self._collect)

    def stop(self) -> None:
        global _active, _saved
        if self._handle is None:
            return
        self._handle.cancel()
        self._handle = None
        with _lock:
            _active -= 1
            if _active == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                _saved = None

    def _collect(self) -> None:
        started = time.perf_counter()
        gc.collect()
        pause_s = time.perf_counter() - started
        self.collections += 1
        self.last_pause_s = pause_s
        if self.on_pause is not None:
            self.on_pause(pause_s)
        log.debug("full collection: %.1f ms", pause_s * 1e3)
        if self._handle is not None and self._loop is not None:
            self._handle = self._loop.call_later(self.every_s, self._collect)
