"""The server's side of an HTTP/2 connection (RFC 9113), without I/O: the bytes a peer sent
go in (`Http2Wire.receive`), what they mean comes out as calls on the owner
(`WireEvents`), and what the server says goes out as bytes (`Http2Wire.data_to_send`).

It keeps what a server must: the preface and the SETTINGS exchange; each stream's state
(open, half closed either way, closed) and the order of their identifiers; header blocks
(HEADERS and CONTINUATION) decoded with HPACK (the hpack library's decoder) and checked as a
request's or trailers' must be; flow control both ways, with WINDOW_UPDATE sent as the owner
acknowledges what it has read, and data sent only as far as the peer's windows go; PING,
RST_STREAM, GOAWAY and PRIORITY; unknown frame types ignored. A fault of the peer's on one
stream resets that stream; one against the connection sends a GOAWAY naming it and raises
`WireError`, after which the connection takes nothing more. A peer that resets its streams in
the same read that opened them, again and again (more than `RESET_AT_ONCE`, and most of the
streams it opened: each costs the server a stream begun for nothing), is such a fault.

Only what a request and response server needs is here: no server push, no priorities, and
header blocks encoded without HPACK's dynamic table (each field a literal, or the static
table's ``:status: 200``), so that nothing the peer says about its table matters.

A client sends the same header block again and again (the same method, path and metadata):
the last block that left the decoder's table as it found it is kept with that table's state,
and the same bytes against the same state are not decoded again (HPACK's decoder, in Python,
is a good part of a small call's cost).
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import hpack

Headers = list[tuple[bytes, bytes]]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# Streams a connection may reset in the read that opened them before it is cut off (when they
# are most of the streams it opened): a client cancels a call at once only now and then.
RESET_AT_ONCE = 100
# settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
FRAME_SIZE = 16_384  # the largest frame this side takes (the protocol's default, not raised)
HEADER_LIST_SIZE = 64 * 1024  # the largest header list a request may carry (decoded)

_HEAD = struct.Struct(">BHBBL")  # a frame's header: length (24 bits), type, flags, stream
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_GOAWAY = struct.Struct(">LL")

_PSEUDO_REQUEST = frozenset((b":method", b":scheme", b":path", b":authority"))
_REQUIRED = frozenset((b":method", b":scheme", b":path"))
_CONNECTION_SPECIFIC = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)


class WireError(Exception):
    """The peer broke the protocol: a GOAWAY naming it is in what is to be sent, and the
    connection takes nothing more."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class WireEvents(Protocol):
    """What the peer did, as the owner of the connection hears it."""

    def opened(self, stream_id: int, headers: Headers) -> None:
        """A request's headers, checked; ``ended`` follows where they end the request."""

    def data(self, stream_id: int, data: bytes, flow_length: int) -> None:
        """Some of a request's body (``flow_length``, padding included, is what the owner
        acknowledges once it has read it)."""

    def ended(self, stream_id: int) -> None:
        """The peer has sent all of the request."""

    def reset(self, stream_id: int) -> None:
        """The stream is gone: the peer reset it, or broke the protocol on it (this side then
        reset it)."""

    def window_opened(self) -> None:
        """There may be room to send where there was none (a WINDOW_UPDATE or SETTINGS)."""

    def peer_left(self) -> None:
        """The peer sent a GOAWAY: it opens no more streams."""


class _Stream:
    __slots__ = ("receive_window", "remote_closed", "send_window", "unacknowledged")

    def __init__(self, send_window: int, receive_window: int) -> None:
        self.send_window = send_window
        self.receive_window = receive_window
        self.unacknowledged = 0  # read by the owner, not yet given back to the peer
        self.remote_closed = False  # (this side's end removes the stream: see `_answered`)


class Http2Wire:
    def __init__(
        self,
        events: WireEvents,
        *,
        max_concurrent_streams: int,
        stream_window: int,
        connection_window: int,
    ) -> None:
        self._events = events
        self._max_streams = max_concurrent_streams
        self._stream_window = stream_window
        self._connection_window = connection_window
        self._streams: dict[int, _Stream] = {}
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = HEADER_LIST_SIZE
        # The last header block that did not change the decoder's table, that table's state
        # and the block's fields (`_decoded`).
        self._last_block = b""
        self._last_state: tuple[int, int] = (-1, -1)
        self._last_front: Any = None  # (held: its identity is compared)
        self._last_headers: Headers = []
        self._in = bytearray()
        self._out: list[bytes] = []
        self._preface = False  # the peer's preface has come
        self._settings = False  # and its first SETTINGS
        self._block: tuple[int, int, list[bytes]] | None = None  # a header block continued
        self._block_size = 0
        self.highest_inbound_stream_id = 0
        self._opened = 0  # streams the peer opened
        self._opened_now: set[int] = set()  # opened in the read being taken
        self._reset_at_once = 0  # reset by the peer in the read that opened them
        self.closed = False  # a GOAWAY for an error sent: nothing more is taken
        # what this side may send
        self._send_window = DEFAULT_WINDOW
        self._peer_stream_window = DEFAULT_WINDOW
        self.max_outbound_frame_size = 16_384
        # what the peer may send, on the connection
        self._receive_window = connection_window
        self._unacknowledged = 0

    # --- what goes out -----------------------------------------------------------------------

    def initiate(self) -> None:
        """The server's preface: its SETTINGS, and the connection's receive window."""
        settings = _SETTING.pack(MAX_CONCURRENT_STREAMS, self._max_streams) + _SETTING.pack(
            INITIAL_WINDOW_SIZE, self._stream_window
        )
        self._frame(SETTINGS, 0, 0, settings)
        if self._connection_window > DEFAULT_WINDOW:
            self._frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._connection_window - DEFAULT_WINDOW))

    def data_to_send(self) -> bytes:
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    def window(self, stream_id: int) -> int:
        """How much may be sent on the stream now (the peer's windows, not the frame size)."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return 0
        return min(self._send_window, stream.send_window)

    def send_headers(self, stream_id: int, headers: Headers, end: bool) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            raise ValueError(f"stream {stream_id} is not open to send on")
        block = b"".join([_field(name, value) for name, value in headers])
        flags = END_STREAM if end else 0
        size = self.max_outbound_frame_size
        if len(block) <= size:
            self._frame(HEADERS, flags | END_HEADERS, stream_id, block)
        else:
            self._frame(HEADERS, flags, stream_id, block[:size])
            for start in range(size, len(block), size):
                last = start + size >= len(block)
                self._frame(
                    CONTINUATION, END_HEADERS if last else 0, stream_id, block[start : start + size]
                )
        if end:
            self._answered(stream_id, stream)

    def send_data(self, stream_id: int, data: bytes, end: bool) -> None:
        """One DATA frame: ``data`` must fit the stream's `window` and the frame size."""
        stream = self._streams.get(stream_id)
        if stream is None:
            raise ValueError(f"stream {stream_id} is not open to send on")
        size = len(data)
        if size > min(self._send_window, stream.send_window, self.max_outbound_frame_size):
            raise ValueError(f"{size} bytes do not fit stream {stream_id}'s window or a frame")
        self._send_window -= size
        stream.send_window -= size
        flags = END_STREAM if end else 0
        self._out.append(_HEAD.pack(size >> 16, size & 0xFFFF, DATA, flags, stream_id))
        if size:
            self._out.append(data)
        if end:
            self._answered(stream_id, stream)

    def reset_stream(self, stream_id: int, code: int) -> None:
        """Reset an open stream (one already closed is left as it is)."""
        if self._streams.pop(stream_id, None) is not None:
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(code))

    def go_away(self, last_stream_id: int, code: int = NO_ERROR, debug: bytes = b"") -> None:
        """Name the last stream this side answers; streams above it are not served."""
        self._frame(GOAWAY, 0, 0, _GOAWAY.pack(last_stream_id, code) + debug)

    def acknowledge(self, stream_id: int, length: int) -> None:
        """The owner has read ``length`` of the stream's data: the peer may send as much
        again (told once half a window has been read, not a frame a read)."""
        self._unacknowledged += length
        if self._unacknowledged >= self._connection_window // 2:
            self._frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._unacknowledged))
            self._receive_window += self._unacknowledged
            self._unacknowledged = 0
        stream = self._streams.get(stream_id)
        if stream is None or stream.remote_closed:
            return  # (the peer sends nothing more on it)
        stream.unacknowledged += length
        if stream.unacknowledged >= self._stream_window // 2:
            self._frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.unacknowledged))
            stream.receive_window += stream.unacknowledged
            stream.unacknowledged = 0

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        size = len(payload)
        self._out.append(_HEAD.pack(size >> 16, size & 0xFFFF, kind, flags, stream_id) + payload)

    def _answered(self, stream_id: int, stream: _Stream) -> None:
        del self._streams[stream_id]
        if not stream.remote_closed:
            # Answered before the request ended: the peer need send no more of it.
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(NO_ERROR))

    # --- what comes in -----------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Take what the peer sent; the owner hears what it means as it is read."""
        if self.closed:
            return
        try:
            self._receive(data)
        except _ConnectionError as error:
            self.closed = True
            self._in.clear()
            self.go_away(self.highest_inbound_stream_id, error.code, str(error).encode()[:256])
            raise WireError(error.code, str(error)) from None

    def _receive(self, data: bytes) -> None:
        if self._opened_now:
            self._opened_now.clear()
        buffer = self._in
        buffer += data
        at = 0
        if not self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise _ConnectionError(PROTOCOL_ERROR, "not HTTP/2's connection preface")
                return
            if buffer[: len(PREFACE)] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not HTTP/2's connection preface")
            self._preface = True
            at = len(PREFACE)
        end = len(buffer)
        while end - at >= 9:
            high, low, kind, flags, stream_id = _HEAD.unpack_from(buffer, at)
            length = high << 16 | low
            if length > FRAME_SIZE:
                raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if end - at - 9 < length:
                break
            payload = bytes(buffer[at + 9 : at + 9 + length])
            at += 9 + length
            self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            if self.closed:
                return
        del buffer[:at]

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is not None and (kind != CONTINUATION or stream_id != self._block[0]):
            raise _ConnectionError(PROTOCOL_ERROR, "a header block interrupted")
        if not self._settings:
            if kind != SETTINGS or flags & ACK:
                raise _ConnectionError(PROTOCOL_ERROR, "the first frame is not SETTINGS")
            self._settings = True
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == RST_STREAM:
            self._on_rst_stream(stream_id, payload)
        elif kind == PING:
            if stream_id or len(payload) != 8:
                raise _ConnectionError(PROTOCOL_ERROR, "a PING on a stream, or not of 8 bytes")
            if not flags & ACK:
                self._frame(PING, ACK, 0, payload)
        elif kind == GOAWAY:
            if stream_id or len(payload) < 8:
                raise _ConnectionError(PROTOCOL_ERROR, "a GOAWAY on a stream, or too short")
            self._events.peer_left()
        elif kind == PRIORITY:
            if not stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "a PRIORITY frame on stream 0")
            if len(payload) != 5:
                self._stream_error(stream_id, FRAME_SIZE_ERROR)
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # (any other type is an extension's: ignored)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        flow = len(payload)
        if flow > self._receive_window:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        self._receive_window -= flow
        data = _unpadded(flags, payload) if flags & PADDED else payload
        stream = self._streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if stream_id > self.highest_inbound_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on stream {stream_id}, not opened")
            # a stream closed (by a reset that crossed this DATA, or ended): dropped, and its
            # share of the connection's window given back
            self.acknowledge(0, flow)
            if stream is not None:
                self._stream_error(stream_id, STREAM_CLOSED)
            return
        if flow > stream.receive_window:
            self.acknowledge(0, flow)
            self._stream_error(stream_id, FLOW_CONTROL_ERROR)
            return
        stream.receive_window -= flow
        if flow:
            self._events.data(stream_id, data, flow)
        if flags & END_STREAM:
            self._end_remote(stream_id)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & PADDED:
            payload = _unpadded(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._on_block(flags, stream_id, payload)
        else:
            self._block = (stream_id, flags, [payload])
            self._block_size = len(payload)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        _, first_flags, parts = self._block
        parts.append(payload)
        self._block_size += len(payload)
        if self._block_size > 2 * HEADER_LIST_SIZE:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "a header block past its limit")
        if flags & END_HEADERS:
            self._block = None
            self._on_block(first_flags, stream_id, b"".join(parts))

    def _decoded(self, block: bytes) -> Headers:
        """A header block's fields, decoded, or as they were the last time these bytes came
        with the decoder's table as it is now."""
        table = self._decoder.header_table
        state = _table_state(table)
        front = _newest(table)
        if block == self._last_block and state == self._last_state and front is self._last_front:
            return list(self._last_headers)
        headers: Headers = self._decoder.decode(block, raw=True)  # type: ignore[assignment]
        if _table_state(table) == state and _newest(table) is front:  # (nothing added or evicted)
            self._last_block, self._last_headers = block, list(headers)
            self._last_state, self._last_front = state, front
        return headers

    def _on_block(self, flags: int, stream_id: int, block: bytes) -> None:
        try:
            headers = self._decoded(block)
        except hpack.OversizedHeaderListError:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "a header list past its limit") from None
        except hpack.HPACKError as error:
            raise _ConnectionError(COMPRESSION_ERROR, f"a header block: {error}") from None
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers
            if stream.remote_closed:
                self._stream_error(stream_id, STREAM_CLOSED)
            elif not flags & END_STREAM or any(name[:1] == b":" for name, _ in headers):
                self._stream_error(stream_id, PROTOCOL_ERROR)
            else:
                self._end_remote(stream_id)
            return
        if stream_id <= self.highest_inbound_stream_id:
            return  # (a stream already closed: nothing more is taken on it)
        self.highest_inbound_stream_id = stream_id
        if len(self._streams) >= self._max_streams:
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM))
            return
        if not _is_request(headers):
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(PROTOCOL_ERROR))
            return
        self._streams[stream_id] = _Stream(self._peer_stream_window, self._stream_window)
        self._opened += 1
        self._opened_now.add(stream_id)
        self._events.opened(stream_id, headers)
        if flags & END_STREAM:
            self._end_remote(stream_id)

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise _ConnectionError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection's window overflowed")
            self._events.window_opened()
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self.highest_inbound_stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on {stream_id}, not opened")
            return
        stream.send_window += increment
        if not increment or stream.send_window > MAX_WINDOW:
            self._stream_error(stream_id, PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)
            return
        self._events.window_opened()

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a body")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for at in range(0, len(payload), 6):
            setting, value = _SETTING.unpack_from(payload, at)
            if setting == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "an initial window past 2^31-1")
                change = value - self._peer_stream_window
                self._peer_stream_window = value
                for stream in self._streams.values():
                    stream.send_window += change
                    if stream.send_window > MAX_WINDOW:
                        raise _ConnectionError(FLOW_CONTROL_ERROR, "a stream's window overflowed")
            elif setting == MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise _ConnectionError(PROTOCOL_ERROR, f"a frame size of {value}")
                self.max_outbound_frame_size = value
            elif setting == ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, "ENABLE_PUSH neither 0 nor 1")
            # (the others bound what this side never does: push, or index headers)
        self._frame(SETTINGS, ACK, 0, b"")
        self._events.window_opened()

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a RST_STREAM not of 4 bytes")
        if not stream_id or stream_id > self.highest_inbound_stream_id:
            raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on stream {stream_id}, not opened")
        if self._streams.pop(stream_id, None) is not None:
            self._events.reset(stream_id)
        if stream_id in self._opened_now:
            self._reset_at_once += 1
            if self._reset_at_once > RESET_AT_ONCE and 2 * self._reset_at_once > self._opened:
                raise _ConnectionError(
                    ENHANCE_YOUR_CALM, "streams reset in the read that opened them, again and again"
                )

    def _end_remote(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:  # (the owner reset it as it heard of it)
            return
        stream.remote_closed = True
        self._events.ended(stream_id)

    def _stream_error(self, stream_id: int, code: int) -> None:
        if self._streams.pop(stream_id, None) is not None:
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(code))
            self._events.reset(stream_id)


def _table_state(table: Any) -> tuple[int, int]:
    """An HPACK decoder's dynamic table: its size limit and its entry count. With its newest
    entry the same object (`_newest`: HPACK adds entries only at the front, a new object each),
    nothing was added, and with the same count nothing was evicted."""
    return table.maxsize, len(table.dynamic_entries)


def _newest(table: Any) -> Any:
    entries = table.dynamic_entries
    return entries[0] if entries else None


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not payload:
        raise _ConnectionError(PROTOCOL_ERROR, "a padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, "padding past the frame's end")
    return payload[1 : len(payload) - pad]


def _is_request(headers: Headers) -> bool:
    """Whether a request's header list is well formed: its pseudo-headers (``:method``,
    ``:scheme`` and ``:path`` once each, ``:authority`` at most once) before the others, every
    name in lower case, no connection-specific field, ``te`` only ``trailers``."""
    seen: set[bytes] = set()
    regular = False
    for name, value in headers:
        if name[:1] == b":":
            if regular or name not in _PSEUDO_REQUEST or name in seen:
                return False
            seen.add(name)
            if name == b":path" and not value:
                return False
        else:
            regular = True
            if name.lower() != name or name in _CONNECTION_SPECIFIC:
                return False
            if name == b"te" and value != b"trailers":
                return False
    return seen >= _REQUIRED


_STATUS_200 = b"\x88"  # (the static table's ``:status: 200``)
_fields: dict[tuple[bytes, bytes], bytes] = {}


def _field(name: bytes, value: bytes) -> bytes:
    """One header field as HPACK's literal without indexing (the status by the static
    table's name); the common ones kept."""
    key = (name, value)
    encoded = _fields.get(key)
    if encoded is not None:
        return encoded
    if name == b":status":
        encoded = _STATUS_200 if value == b"200" else b"\x08" + _string(value)
    else:
        encoded = b"\x00" + _string(name) + _string(value)
    if len(_fields) < 4096 and len(encoded) < 256:
        _fields[key] = encoded
    return encoded


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7) + data


def _integer(value: int, bits: int) -> bytes:
    """HPACK's integer in a prefix of ``bits`` bits (the prefix's other bits 0)."""
    limit = (1 << bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
