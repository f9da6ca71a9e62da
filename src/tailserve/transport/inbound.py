"""How the HTTP/1.1 server (transport/server.py, the worker's and the router's) reads a
request's head from a client: its limits, its timeouts, and how an error ends a connection."""

from __future__ import annotations

import asyncio
from typing import Protocol

import httptools

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A request's line and headers together may not be longer (431).
MAX_HEAD_BYTES = 64 * 1024
# How long a connection ended by an error lingers, reading and dropping what still comes.
LINGER_S = 2.0


class Reader(Protocol):
    """A connection reading requests with httptools' parser."""

    @property
    def in_message(self) -> bool:
        """Between a request's first byte and its last."""

    def end(self, status: int | None, message: str = "") -> None:
        """Read nothing more; the requests already read are answered, then ``status`` (when
        given) answers the one that could not be read, and the connection closes."""


def feed(parser: httptools.HttpRequestParser, data: bytes, reader: Reader) -> None:
    """Give the parser the bytes that came. A whole request that asked for a protocol upgrade
    is answered over HTTP/1.1 (the upgrade ignored), and the connection closed after it; one
    cut short is refused, and so is a request the parser cannot read (400)."""
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        if reader.in_message:
            reader.end(400, "protocol upgrades are not supported")
        else:
            reader.end(None)
    except httptools.HttpParserError as exc:
        reader.end(400, f"malformed HTTP request: {exc}")


def head_of(headers: list[tuple[bytes, bytes]], version: str) -> tuple[int | None, bool]:
    """From a request's headers (names lower-cased): its declared body length (None: none
    given, or not a number), and whether the client waits for a ``100 Continue`` before it
    sends its body (curl does, past 1 KiB; never an HTTP/1.0 client)."""
    declared = expect = None
    for name, value in headers:
        if name == b"content-length":
            declared = value
        elif name == b"expect":
            expect = value
    length = int(declared) if declared is not None and declared.strip().isdigit() else None
    waits = expect is not None and expect.lower() == b"100-continue" and version != "1.0"
    return length, waits


def too_long(head_fed: int) -> bool:
    """Whether the bytes of the reads that went wholly to a request's head are past what any
    head within the limit takes (httptools holds a header whole before it calls back, so one
    header that never ends is only seen here)."""
    return head_fed > 2 * MAX_HEAD_BYTES


def late(
    in_head: bool,
    begun: float,
    heard: float,
    now: float,
    timeout_s: float,
    head_timeout_s: float | None = None,
) -> str | None:
    """Why a request still being read is refused with 408 (None: it is not late). Its head
    must be whole within ``head_timeout_s`` (default: ``timeout_s``) of its first byte,
    however it trickles in (a client
    that sends a byte now and then holds a connection forever otherwise); its body may take
    as long as it needs, but not stop for ``timeout_s``. ``heard``: when bytes last came, or
    when the server last stopped holding the client back (reading paused, a 100 Continue owed),
    which is no fault of the client's."""
    if in_head:
        head_s = timeout_s if head_timeout_s is None else head_timeout_s
        if now - begun > head_s:
            return f"request head not received within {head_s:g} s"
    elif now - heard > timeout_s:
        return f"request body stalled: nothing received for {timeout_s:g} s"
    return None


class HeadReading:
    """What the server's connections do while a request's head is read: the target and
    headers kept within `MAX_HEAD_BYTES` (414, 431), and whether the request being read is late
    (`late`, with the time the server holds the client back not counted)."""

    _url: bytes
    _headers: list[tuple[bytes, bytes]]
    _head_size: int
    _in_head: bool
    _started: float
    _heard: float
    _held: float
    _reading_paused: bool
    _continue_owed: bool

    def end(self, status: int | None, message: str = "") -> None:
        raise NotImplementedError

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD_BYTES:
            self.end(414, f"request target over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD_BYTES:
            self.end(431, f"request headers over {MAX_HEAD_BYTES} bytes")

    def _late(
        self, now: float, timeout_s: float, head_timeout_s: float | None = None
    ) -> str | None:
        """Why the request being read is refused now (None: it is in time, or held back)."""
        if self._reading_paused or self._continue_owed:
            self._heard = self._held = now
            return None
        begun = max(self._started, self._held)
        return late(self._in_head, begun, self._heard, now, timeout_s, head_timeout_s)


def close_after(transport: asyncio.Transport, *, ended: bool) -> None:
    """Close a connection once its last reply is written. One that an error ended (408, 413,
    431, 400) may have a client still sending: closed with those bytes unread, the kernel
    resets the connection and the client may lose the reply that says why. So its sending side
    shuts after the reply, and what still comes is read (the connection drops it) for up to
    `LINGER_S` before the close."""
    if ended and transport.can_write_eof():
        transport.write_eof()
        transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)
    else:
        transport.close()
