"""A sampled log of inference requests that `tailserve bench` replays with the original timing.

One JSON line per sampled request: ``t`` (seconds since the epoch, float), ``method``, ``path``,
the headers that shape the request (content type, binary header length, deadline, options) and
the body (after any Content-Encoding was undone), base64-encoded. The event loop only appends to
a bounded queue; a writer thread does the file I/O. When the queue is full the line is dropped
and counted, never waited for.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import queue
import random
import threading
import time
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)

RECORDED_HEADERS = (
    b"content-type",
    b"inference-header-content-length",
    b"x-deadline-ms",
    b"x-priority",
    b"x-cache-mode",
    b"x-affinity-key",
)


class TraceRecorder:
    def __init__(self, path: Path, *, sample: float = 1.0, max_pending: int = 10_000) -> None:
        if not 0.0 < sample <= 1.0:
            raise ValueError("trace sample rate must be in (0, 1]")
        self.path = path
        self.sample = sample
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=max_pending)
        self._random = random.Random()
        self._thread = threading.Thread(target=self._write, name="tailserve-trace", daemon=True)
        self._thread.start()

    def record(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        if self.sample < 1.0 and self._random.random() >= self.sample:
            return
        kept = {k.decode(): v.decode("latin-1") for k, v in headers if k in RECORDED_HEADERS}
        line: dict[str, Any] = {
            "t": time.time(),
            "method": method,
            "path": path,
            "headers": kept,
            "body": base64.b64encode(body).decode(),
        }
        try:
            self._queue.put_nowait(orjson.dumps(line) + b"\n")
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5)
        self._thread.join(timeout=10)
        if self.dropped:
            log.warning("trace log %s: %d lines dropped (writer behind)", self.path, self.dropped)

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as out:
            while True:
                line = self._queue.get()
                if line is None:
                    return
                out.write(line)
                self.written += 1
                if self._queue.empty():
                    out.flush()


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The recorded requests in time order, bodies decoded."""
    entries = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                entry = orjson.loads(raw)
                entry["body"] = base64.b64decode(entry["body"])
            except (orjson.JSONDecodeError, KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: not a trace line: {exc}") from None
            entries.append(entry)
    entries.sort(key=lambda entry: entry["t"])
    return entries
