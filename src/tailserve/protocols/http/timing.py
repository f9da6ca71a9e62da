"""uvicorn's httptools protocol, noting when each request began to arrive.

A request's deadline should count from when it reached the worker, not from when its task got
to run: on a busy event loop the two are milliseconds apart, and that wait is invisible to
anything inside the application. The time goes into the ASGI scope under `RECEIVED`.
"""

from __future__ import annotations

import time
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

RECEIVED = "tailserve.received_at"


class TimedHttpToolsProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        # The scope is typed as ASGI's; servers may add their own keys to it.
        cast(dict[str, Any], self.scope)[RECEIVED] = time.monotonic()
