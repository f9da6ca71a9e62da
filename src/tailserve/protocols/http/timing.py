"""uvicorn's httptools protocol, noting when each request began to arrive and cancelling the
work of a client that hangs up.

A request's deadline should count from when it reached the worker, not from when its task got
to run: on a busy event loop the two are milliseconds apart, and that wait is invisible to
anything inside the application. The time goes into the ASGI scope under `RECEIVED`.

A client that closes its connection before the reply (the losing copy of a hedged request, a
caller that gave up) no longer wants the answer: its task is cancelled at once, so a request
still queued for a batch leaves the queue and costs the model nothing. The scope is marked
`DISCONNECTED` first, so the application tells this cancellation from any other.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

RECEIVED = "tailserve.received_at"
DISCONNECTED = "tailserve.disconnected"


class TimedHttpToolsProtocol(HttpToolsProtocol):
    _task: asyncio.Task[None] | None = None
    _task_cycle: Any = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The scope is typed as ASGI's; servers may add their own keys to it.
        cast(dict[str, Any], self.scope)[RECEIVED] = time.monotonic()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # uvicorn's own, less its opt-in context reset, keeping the task at hand to cancel.
        task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        self._task, self._task_cycle = task, cycle

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        task = self._task
        super().connection_lost(exc)
        if cycle is None or cycle.response_complete or task is None or task.done():
            return
        if self._task_cycle is cycle:
            cast(dict[str, Any], cycle.scope)[DISCONNECTED] = True
            task.cancel()
