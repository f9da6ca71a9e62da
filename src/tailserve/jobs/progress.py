"""A batch job's checkpoint (how many input lines are done, replaced atomically) and its
progress line."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, TextIO

import orjson

from tailserve.errors import ConfigError


class Checkpoint:
    """How many input lines are done, for one model version and input file."""

    def __init__(self, path: Path, identity: dict[str, Any]) -> None:
        self.path = path
        self.identity = identity

    def load(self) -> int:
        try:
            document = orjson.loads(self.path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(f"checkpoint {self.path}: cannot read it: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("lines_done"), int):
            raise ConfigError(f"checkpoint {self.path}: not a precompute checkpoint")
        for name, value in self.identity.items():
            if document.get(name) != value:
                raise ConfigError(
                    f"checkpoint {self.path} is for {name} {document.get(name)!r}, not "
                    f"{value!r}: give another --checkpoint, or delete it to start over"
                )
        done: int = document["lines_done"]
        return done

    def save(self, lines_done: int, **extra: Any) -> None:
        """Write beside the file, then rename over it: a crash leaves the old or the new."""
        document = {**self.identity, "lines_done": lines_done, **extra}
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        with partial.open("wb") as out:
            out.write(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)


class Progress:
    """A progress line on a stream: done/total, rate, ETA; redrawn in place on a terminal,
    else printed every few seconds."""

    def __init__(self, label: str, total: int, stream: TextIO | None, *, start: int = 0):
        self.label = label
        self.total = total
        self.stream = stream
        self.start = start
        self.started = time.monotonic()
        self.tty = stream is not None and stream.isatty()
        self.every_s = 0.25 if self.tty else 5.0
        self.shown = self.started
        self.width = 0

    def update(self, done: int, note: str = "", *, final: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if not final and now - self.shown < self.every_s:
            return
        self.shown = now
        elapsed = max(now - self.started, 1e-9)
        rate = (done - self.start) / elapsed
        left = (self.total - done) / rate if rate > 0 else float("inf")
        share = done / self.total if self.total else 1.0
        line = (
            f"{self.label}: {done:,}/{self.total:,} ({share:.0%})  {rate:,.0f}/s  "
            f"ETA {_duration(left)}  {note}"
        ).rstrip()
        if self.tty:
            self.width = max(self.width, len(line))
            self.stream.write("\r" + line.ljust(self.width) + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "--:--"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
