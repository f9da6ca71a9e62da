"""The server's side of HTTP/2 (`transport.http2_wire`), without a socket: what an HTTP/2
client (h2's) sends goes in, what the wire says goes back to it; frames no well-behaved client
sends are built by hand (hyperframe's)."""

from __future__ import annotations

from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.http2_frames import parse
from tailserve.transport import http2_wire
from tailserve.transport.http2_wire import Http2Wire, WireError

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "t")]
RAW_REQUEST = [(name.encode(), value.encode()) for name, value in REQUEST]


class Owner:
    """Keeps what the wire tells it, in order; answers nothing of itself."""

    def __init__(self) -> None:
        self.heard: list[tuple[Any, ...]] = []

    def opened(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.heard.append(("opened", stream_id, headers))

    def data(self, stream_id: int, data: bytes, flow_length: int) -> None:
        self.heard.append(("data", stream_id, data, flow_length))

    def ended(self, stream_id: int) -> None:
        self.heard.append(("ended", stream_id))

    def reset(self, stream_id: int) -> None:
        self.heard.append(("reset", stream_id))

    def window_opened(self) -> None:
        self.heard.append(("window",))

    def peer_left(self) -> None:
        self.heard.append(("left",))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [event for event in self.heard if event[0] == kind]


class Pair:
    """A wire and an h2 client, their bytes passed between them by hand."""

    def __init__(self, **options: Any) -> None:
        self.owner = Owner()
        self.wire = Http2Wire(
            self.owner,
            max_concurrent_streams=options.get("streams", 100),
            stream_window=options.get("stream_window", 1 << 20),
            connection_window=options.get("connection_window", 4 << 20),
        )
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
        self.events: list[Any] = []
        self.wire.initiate()
        self.client.initiate_connection()
        self.to_server()
        self.to_client()
        self.to_server()  # (the client's acknowledgement of the server's SETTINGS)
        self.owner.heard.clear()

    def to_server(self, data: bytes | None = None) -> None:
        self.wire.receive(self.client.data_to_send() if data is None else data)

    def to_client(self) -> list[Any]:
        events = self.client.receive_data(self.wire.data_to_send())
        self.events.extend(events)
        return events

    def raw(self, frame: Frame) -> None:
        self.wire.receive(frame.serialize())

    def frames(self) -> list[Frame]:
        """What the wire has to send, as frames (not through the client)."""
        return parse(self.wire.data_to_send())

    def request(self, body: bytes = b"", **headers: str) -> int:
        stream_id: int = self.client.get_next_available_stream_id()
        extra = [(name.replace("_", "-"), value) for name, value in headers.items()]
        self.client.send_headers(stream_id, REQUEST + extra, end_stream=not body)
        if body:
            self.client.send_data(stream_id, body, end_stream=True)
        self.to_server()
        return stream_id


def headers_frame(stream_id: int, headers: list[tuple[bytes, bytes]], **kwargs: Any) -> Frame:
    frame = HeadersFrame(stream_id, hpack.Encoder().encode(headers), **kwargs)
    return frame


def the_goaway(pair: Pair) -> GoAwayFrame:
    (away,) = [frame for frame in pair.frames() if isinstance(frame, GoAwayFrame)]
    return away


def test_the_preface_carries_the_servers_settings_and_window() -> None:
    owner = Owner()
    wire = Http2Wire(
        owner, max_concurrent_streams=7, stream_window=1 << 20, connection_window=1 << 22
    )
    wire.initiate()
    settings_frame, window = parse(wire.data_to_send())
    assert isinstance(settings_frame, SettingsFrame)
    assert settings_frame.settings == {
        SettingsFrame.MAX_CONCURRENT_STREAMS: 7,
        SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 20,
    }
    assert isinstance(window, WindowUpdateFrame)
    assert (window.stream_id, window.window_increment) == (0, (1 << 22) - 65_535)


def test_a_request_and_its_answer_pass_whole() -> None:
    pair = Pair()
    stream = pair.request(b"hello", x_tag="1")
    opened, data, ended = pair.owner.heard[-3:]
    assert opened == ("opened", stream, [*RAW_REQUEST, (b"x-tag", b"1")])
    assert data == ("data", stream, b"hello", 5)
    assert ended == ("ended", stream)
    pair.wire.send_headers(stream, [(b":status", b"200"), (b"content-type", b"x/y")], False)
    pair.wire.send_data(stream, b"world", False)
    pair.wire.send_headers(stream, [(b"grpc-status", b"0")], True)
    events = pair.to_client()
    response, body, trailers, end = events
    assert response.headers == [(b":status", b"200"), (b"content-type", b"x/y")]
    assert body.data == b"world"
    assert trailers.headers == [(b"grpc-status", b"0")]
    assert isinstance(end, h2.events.StreamEnded)
    assert pair.wire.window(stream) == 0  # (closed both ways: nothing more to send on it)


def test_any_status_and_long_values_are_encoded_as_the_peer_decodes_them() -> None:
    pair = Pair()
    stream = pair.request()
    long_value = b"v" * 40_000  # (past a frame: HEADERS then CONTINUATION)
    pair.wire.send_headers(stream, [(b":status", b"503"), (b"x-long", long_value)], True)
    frames = pair.frames()
    assert [type(frame) for frame in frames] == [HeadersFrame, ContinuationFrame, ContinuationFrame]
    pair.events.extend(pair.client.receive_data(b"".join(f.serialize() for f in frames)))
    (response,) = [e for e in pair.events if isinstance(e, h2.events.ResponseReceived)]
    assert response.headers == [(b":status", b"503"), (b"x-long", long_value)]


def test_a_request_in_a_header_block_continued_and_padded_frames() -> None:
    pair = Pair()
    block = hpack.Encoder().encode([*RAW_REQUEST, (b"x-big", b"b" * 20_000)])
    first = HeadersFrame(1, block[:100], flags=["PADDED", "PRIORITY"], pad_length=7)
    first.depends_on, first.stream_weight = 0, 16
    pair.raw(first)
    assert pair.owner.heard == []  # (the block is not whole yet)
    pair.raw(ContinuationFrame(1, block[100:16_000]))
    pair.raw(ContinuationFrame(1, block[16_000:], flags=["END_HEADERS"]))
    pair.raw(DataFrame(1, b"padded", flags=["PADDED", "END_STREAM"], pad_length=10))
    opened, data, ended = pair.owner.heard
    assert opened[2][-1] == (b"x-big", b"b" * 20_000)
    assert data == ("data", 1, b"padded", 17)  # (the pad's length byte and pad counted)
    assert ended == ("ended", 1)


def test_bytes_split_anywhere_read_the_same() -> None:
    pair = Pair()
    pair.client.send_headers(1, REQUEST)
    pair.client.send_data(1, b"in pieces", end_stream=True)
    for byte in pair.client.data_to_send():
        pair.to_server(bytes((byte,)))
    assert [event[0] for event in pair.owner.heard] == ["opened", "data", "ended"]
    assert pair.owner.of("data")[0][2] == b"in pieces"


def test_a_ping_is_answered_and_settings_acknowledged() -> None:
    pair = Pair()
    pair.raw(PingFrame(0, opaque_data=b"12345678"))
    pair.raw(SettingsFrame(0, settings={SettingsFrame.HEADER_TABLE_SIZE: 0}))
    ping, ack = pair.frames()
    assert isinstance(ping, PingFrame) and "ACK" in ping.flags and ping.opaque_data == b"12345678"
    assert isinstance(ack, SettingsFrame) and "ACK" in ack.flags


def test_data_goes_only_as_far_as_the_peers_windows() -> None:
    pair = Pair()
    stream = pair.request()
    assert pair.wire.window(stream) == 65_535
    with pytest.raises(ValueError, match="window"):
        pair.wire.send_data(stream, b"x" * 16_385, False)  # (past a frame, too)
    pair.wire.send_headers(stream, [(b":status", b"200")], False)
    for _ in range(4):
        pair.wire.send_data(stream, b"x" * 16_383, False)
    assert pair.wire.window(stream) == 65_535 - 4 * 16_383
    pair.to_client()  # (h2 acknowledges nothing of itself)
    pair.client.acknowledge_received_data(4 * 16_383, stream)
    pair.to_server()
    assert pair.owner.of("window")
    assert pair.wire.window(stream) == 65_535


def test_the_peers_settings_move_its_windows_and_frame_size() -> None:
    pair = Pair()
    stream = pair.request()
    pair.client.update_settings(
        {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1_000,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 1 << 20,
        }
    )
    pair.to_server()
    assert pair.wire.window(stream) == 1_000
    assert pair.wire.max_outbound_frame_size == 1 << 20
    pair.raw(WindowUpdateFrame(0, window_increment=1 << 20))
    pair.raw(WindowUpdateFrame(stream, window_increment=1 << 20))
    assert pair.wire.window(stream) == 1_000 + (1 << 20)


def test_reads_are_given_back_once_half_a_window_is_read() -> None:
    pair = Pair(stream_window=100_000, connection_window=1 << 22)
    stream = pair.client.get_next_available_stream_id()
    pair.client.send_headers(stream, REQUEST)
    for _ in range(4):
        pair.client.send_data(stream, b"x" * 10_000)
    pair.to_server()
    pair.frames()
    pair.wire.acknowledge(stream, 40_000)
    assert pair.frames() == []  # (not yet half of 100,000)
    pair.wire.acknowledge(stream, 10_000)
    (update,) = pair.frames()
    assert isinstance(update, WindowUpdateFrame)
    assert (update.stream_id, update.window_increment) == (stream, 50_000)


def test_data_past_a_streams_window_resets_it_and_the_others_go_on() -> None:
    pair = Pair(stream_window=20_000)
    pair.raw(headers_frame(1, RAW_REQUEST, flags=["END_HEADERS"]))
    pair.raw(headers_frame(3, RAW_REQUEST, flags=["END_HEADERS"]))
    pair.raw(DataFrame(1, b"x" * 15_000))
    pair.raw(DataFrame(1, b"x" * 15_000))
    (reset,) = pair.frames()
    assert isinstance(reset, RstStreamFrame) and reset.stream_id == 1
    assert reset.error_code == http2_wire.FLOW_CONTROL_ERROR
    assert pair.owner.of("reset") == [("reset", 1)]
    pair.raw(DataFrame(3, b"fine", flags=["END_STREAM"]))
    assert pair.owner.heard[-2:] == [("data", 3, b"fine", 4), ("ended", 3)]


def test_streams_past_the_limit_are_refused() -> None:
    pair = Pair(streams=2)
    for stream_id in (1, 3, 5):
        pair.raw(headers_frame(stream_id, RAW_REQUEST, flags=["END_HEADERS"]))
    (refused,) = pair.frames()
    assert isinstance(refused, RstStreamFrame)
    assert (refused.stream_id, refused.error_code) == (5, http2_wire.REFUSED_STREAM)
    assert [event[1] for event in pair.owner.of("opened")] == [1, 3]


@pytest.mark.parametrize(
    "headers",
    [
        [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"t")],  # no :path
        [*RAW_REQUEST, (b"X-Upper", b"1")],
        [*RAW_REQUEST, (b"connection", b"keep-alive")],
        [*RAW_REQUEST, (b"te", b"gzip")],
        [(b"x-first", b"1"), *RAW_REQUEST],  # a pseudo-header after a regular one
        [*RAW_REQUEST, (b":status", b"200")],  # a response's pseudo-header
        [*RAW_REQUEST, (b":path", b"/again")],
    ],
    ids=["no-path", "upper-case", "connection", "te", "pseudo-late", "status", "path-twice"],
)
def test_a_malformed_request_is_reset_and_never_opened(
    headers: list[tuple[bytes, bytes]],
) -> None:
    pair = Pair()
    pair.raw(headers_frame(1, headers, flags=["END_HEADERS", "END_STREAM"]))
    (reset,) = pair.frames()
    assert isinstance(reset, RstStreamFrame)
    assert (reset.stream_id, reset.error_code) == (1, http2_wire.PROTOCOL_ERROR)
    assert pair.owner.heard == []


def test_trailers_end_a_request_and_pseudo_headers_in_them_reset_it() -> None:
    pair = Pair()
    encoder = hpack.Encoder()
    pair.raw(HeadersFrame(1, encoder.encode(RAW_REQUEST), flags=["END_HEADERS"]))
    pair.raw(HeadersFrame(1, encoder.encode([(b"x-t", b"1")]), flags=["END_HEADERS", "END_STREAM"]))
    assert pair.owner.heard[-1] == ("ended", 1)
    pair.raw(HeadersFrame(3, encoder.encode(RAW_REQUEST), flags=["END_HEADERS"]))
    pair.raw(
        HeadersFrame(3, encoder.encode([(b":path", b"/")]), flags=["END_HEADERS", "END_STREAM"])
    )
    assert pair.owner.heard[-1] == ("reset", 3)


def test_a_peer_reset_is_heard_and_what_crossed_it_dropped() -> None:
    pair = Pair()
    pair.raw(headers_frame(1, RAW_REQUEST, flags=["END_HEADERS"]))
    pair.raw(RstStreamFrame(1, error_code=http2_wire.CANCEL))
    pair.raw(DataFrame(1, b"late"))
    assert pair.owner.heard[-1] == ("reset", 1)
    assert pair.frames() == []
    pair.raw(GoAwayFrame(0, last_stream_id=0))
    assert pair.owner.of("left") == [("left",)]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (DataFrame(5, b"x"), http2_wire.PROTOCOL_ERROR),  # a stream never opened
        (HeadersFrame(2, b"", flags=["END_HEADERS"]), http2_wire.PROTOCOL_ERROR),  # even
        (HeadersFrame(1, b"\xff\xff\xff\xff", flags=["END_HEADERS"]), http2_wire.COMPRESSION_ERROR),
        (ContinuationFrame(1, b"", flags=["END_HEADERS"]), http2_wire.PROTOCOL_ERROR),
        (WindowUpdateFrame(0, window_increment=2**31 - 1), http2_wire.FLOW_CONTROL_ERROR),
        (RstStreamFrame(9, error_code=0), http2_wire.PROTOCOL_ERROR),  # never opened
        (SettingsFrame(0, settings={SettingsFrame.MAX_FRAME_SIZE: 100}), http2_wire.PROTOCOL_ERROR),
        (DataFrame(1, b"x" * 16_385), http2_wire.FRAME_SIZE_ERROR),
    ],
    ids=["data-idle", "even", "hpack", "continuation", "overflow", "rst-idle", "frame-size", "big"],
)
def test_a_fault_against_the_connection_sends_a_goaway_and_takes_nothing_more(
    frame: Frame, code: int
) -> None:
    pair = Pair()
    with pytest.raises(WireError) as raised:
        pair.raw(frame)
    assert raised.value.code == code
    away = the_goaway(pair)
    assert away.error_code == code
    pair.raw(headers_frame(11, RAW_REQUEST, flags=["END_HEADERS"]))
    assert pair.owner.of("opened") == [] and pair.frames() == []


def test_a_header_block_interrupted_is_a_fault() -> None:
    pair = Pair()
    pair.raw(headers_frame(1, RAW_REQUEST))  # (no END_HEADERS)
    with pytest.raises(WireError, match="interrupted"):
        pair.raw(PingFrame(0, opaque_data=b"12345678"))
    assert the_goaway(pair).error_code == http2_wire.PROTOCOL_ERROR


def test_a_peer_that_does_not_speak_http2_or_skips_its_settings_is_refused() -> None:
    owner = Owner()
    wire = Http2Wire(
        owner, max_concurrent_streams=1, stream_window=1 << 16, connection_window=1 << 16
    )
    with pytest.raises(WireError, match="preface"):
        wire.receive(b"GET / HTTP/1.1\r\n")
    wire = Http2Wire(
        owner, max_concurrent_streams=1, stream_window=1 << 16, connection_window=1 << 16
    )
    with pytest.raises(WireError, match="SETTINGS"):
        wire.receive(http2_wire.PREFACE + PingFrame(0, opaque_data=b"12345678").serialize())


def test_a_connection_fault_names_the_last_stream_opened() -> None:
    pair = Pair()
    pair.request(b"one")
    pair.frames()
    with pytest.raises(WireError):
        pair.raw(DataFrame(7, b"x"))
    assert the_goaway(pair).last_stream_id == 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(0, 12), st.integers(0, 255), st.integers(0, 9), st.binary(max_size=40)
        ),
        max_size=12,
    )
)
def test_any_frames_a_peer_sends_end_in_a_fault_named_or_are_served(
    frames: list[tuple[int, int, int, bytes]],
) -> None:
    """Whatever frames come (any type, flags, stream and payload), the wire either takes them
    or raises WireError with a GOAWAY: never another exception."""
    pair = Pair()
    data = b"".join(
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
        for kind, flags, stream, payload in frames
    )
    try:
        pair.to_server(data)
    except WireError as error:
        assert the_goaway(pair).error_code == error.code
    else:
        for frame in pair.frames():
            assert not isinstance(frame, GoAwayFrame)


def test_an_answer_before_the_request_ends_tells_the_peer_to_stop_sending() -> None:
    pair = Pair()
    pair.raw(headers_frame(1, RAW_REQUEST, flags=["END_HEADERS"]))
    pair.wire.send_headers(1, [(b":status", b"413")], True)
    answer, stop = pair.frames()
    assert isinstance(answer, HeadersFrame) and "END_STREAM" in answer.flags
    assert isinstance(stop, RstStreamFrame)
    assert (stop.stream_id, stop.error_code) == (1, http2_wire.NO_ERROR)
    pair.raw(DataFrame(1, b"x" * 1_000, flags=["END_STREAM"]))  # (it crossed the reset)
    assert pair.owner.of("data") == [] and pair.frames() == []
    assert pair.wire.window(1) == 0


# A request's header block by hand: :method POST, :scheme http, :path / (the static table's),
# then :authority t as a literal not indexed.
BASE = b"\x83\x86\x84\x01\x01t"


def _indexed_tag(value: bytes) -> bytes:
    """``x-tag: value`` as a literal added to the dynamic table."""
    return b"\x40\x05x-tag" + bytes([len(value)]) + value


def _opened(pair: Pair, block: bytes) -> list[tuple[bytes, bytes]]:
    """The fields of a request sent as ``block``."""
    stream = pair.client.get_next_available_stream_id()
    pair.client.send_headers(stream, REQUEST, end_stream=True)  # (keeps h2's ids in step)
    pair.client.data_to_send()
    pair.raw(HeadersFrame(stream, block, flags=["END_HEADERS", "END_STREAM"]))
    (opened,) = [event for event in pair.owner.of("opened") if event[1] == stream]
    fields: list[tuple[bytes, bytes]] = opened[2]
    return fields


def test_a_header_block_sent_again_is_read_as_the_table_now_reads_it() -> None:
    pair = Pair()
    tag = (b"x-tag", b"A")
    assert _opened(pair, BASE + _indexed_tag(b"A"))[-1] == tag
    newest = BASE + b"\xbe"  # (the dynamic table's newest entry)
    assert _opened(pair, newest)[-1] == tag
    assert _opened(pair, newest)[-1] == tag
    assert _opened(pair, BASE + _indexed_tag(b"B"))[-1] == (b"x-tag", b"B")
    assert _opened(pair, newest)[-1] == (b"x-tag", b"B")
    assert _opened(pair, BASE + b"\xbf")[-1] == tag
    # The same bytes adding to the table each time are decoded each time.
    again = BASE + _indexed_tag(b"C")
    assert _opened(pair, again)[-1] == _opened(pair, again)[-1] == (b"x-tag", b"C")
    assert _opened(pair, BASE + b"\xbf")[-1] == (b"x-tag", b"C")
    assert _opened(pair, BASE + b"\xc0")[-1] == (b"x-tag", b"B")


def test_a_header_block_that_leaves_the_table_alone_is_decoded_once() -> None:
    pair = Pair()
    decoder = pair.wire._decoder
    calls = []
    decode = decoder.decode

    def counted(data: bytes, raw: bool = False) -> Any:
        calls.append(data)
        return decode(data, raw=raw)

    decoder.decode = counted  # type: ignore[method-assign]
    block = BASE + b"\x00\x05x-tag\x01A"  # (x-tag: A as a literal not indexed)
    first = _opened(pair, block)
    first.append((b"x-more", b"1"))  # (what one stream's owner does is its own)
    assert (
        _opened(pair, block)
        == _opened(pair, block)
        == [*RAW_REQUEST[:2], (b":path", b"/"), (b":authority", b"t"), (b"x-tag", b"A")]
    )
    assert calls == [block]


def _opened_and_reset(pair: Pair, count: int) -> bytes:
    """``count`` requests, each reset by the client as soon as it is sent, as bytes."""
    for _ in range(count):
        stream = pair.client.get_next_available_stream_id()
        pair.client.send_headers(stream, REQUEST, end_stream=True)
        pair.client.reset_stream(stream)
    data: bytes = pair.client.data_to_send()
    return data


def test_a_peer_resetting_each_stream_as_it_opens_it_is_cut_off() -> None:
    pair = Pair(streams=1000)
    limit = http2_wire.RESET_AT_ONCE
    with pytest.raises(WireError, match="reset in the read that opened them") as raised:
        pair.to_server(_opened_and_reset(pair, limit + 50))
    assert raised.value.code == http2_wire.ENHANCE_YOUR_CALM
    assert the_goaway(pair).error_code == http2_wire.ENHANCE_YOUR_CALM
    assert len(pair.owner.of("opened")) == len(pair.owner.of("reset")) == limit + 1


def test_a_client_cancelling_calls_later_or_now_and_then_is_served_on() -> None:
    pair = Pair(streams=2000)
    limit = http2_wire.RESET_AT_ONCE
    for _ in range(limit + 50):  # (each reset in a read after the one that opened it)
        stream = pair.request()
        pair.client.reset_stream(stream)
        pair.to_server()
    for _ in range(4 * limit):
        pair.request()
    pair.to_server(_opened_and_reset(pair, limit + 50))  # (a minority of its streams)
    stream = pair.request()
    assert pair.owner.heard[-2:] == [("opened", stream, RAW_REQUEST), ("ended", stream)]
    assert not pair.wire.closed
