"""One HTTP request as the worker's server hands it to the application: read whole, the body
already held to the size limit (`server.py` refuses a larger one before it reaches here)."""

from __future__ import annotations

import zlib
from typing import Any
from urllib.parse import unquote

import httptools
import orjson

from tailserve.errors import InvalidInput, PayloadTooLarge, shown


class HttpRequest:
    __slots__ = (
        "disconnected",
        "error",
        "headers",
        "keep_alive",
        "max_body_bytes",
        "memo_key",
        "method",
        "options",
        "params",
        "path",
        "raw_body",
        "received_at",
        "route",
        "screened",
        "target",
        "version",
    )

    def __init__(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        received_at: float,
        max_body_bytes: int,
        keep_alive: bool = True,
        version: str = "1.1",
    ) -> None:
        self.method = method
        # As sent (query string and escapes kept): what a proxy forwards.
        self.target = target
        if target[:1] == b"/":
            path = target.split(b"?", 1)[0].decode("latin-1")
        else:  # absolute-form (a client that speaks as if to a proxy), or "*"
            path = _path_of(target)
        self.path = unquote(path) if "%" in path else path
        # Names lower-cased, in the order they came.
        self.headers = headers
        self.raw_body = body
        # Deadlines count from here: when the server began to read the request (the clock is
        # the scheduler's, time.monotonic).
        self.received_at = received_at
        self.max_body_bytes = max_body_bytes
        self.keep_alive = keep_alive
        self.version = version
        # Set by the application once it has matched the route.
        self.params: dict[str, str] = {}
        self.route: Any = None
        # What the application read of its headers, once (an inference's options).
        self.options: Any = None
        # Its identity in the reply memo, where the application looked it up there.
        self.memo_key: bytes | None = None
        # The client hung up before its reply: the work for it was cancelled.
        self.disconnected = False
        # Its model's shed admitted it before it was decoded (`DataPlane.shed`).
        self.screened = False
        # Refused before the application saw it (status, message): a body over the limit.
        self.error: tuple[int, str] | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def body(self) -> bytes:
        """The whole body, decompressed (and held to the limit once decompressed)."""
        return self.decoded_body()

    def decoded_body(self) -> bytes:
        body = self.raw_body
        encoding = self.header(b"content-encoding")
        if encoding is not None and encoding not in (b"identity", b""):
            body = _decompress(encoding, body, self.max_body_bytes)
        return body

    async def json(self) -> Any:
        body = await self.body()
        if not body:
            return {}
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"request body is not valid JSON: {exc}") from None


def _path_of(target: bytes) -> str:
    try:
        parsed = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        return target.decode("latin-1")
    return (parsed.path or b"/").decode("latin-1")


def _decompress(encoding: bytes, body: bytes, limit: int) -> bytes:
    # "deflate" on the wire is zlib-wrapped; gzip has its own header. Both capped at the limit.
    wbits = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}.get(encoding.lower())
    if wbits is None:
        raise InvalidInput(
            f"unsupported Content-Encoding {shown(encoding)} (supported: gzip, deflate)"
        )
    name = encoding.decode(errors="replace")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
        # gzip may hold several members one after another (RFC 1952): each is read in turn.
        while (
            wbits != zlib.MAX_WBITS and inflater.eof and inflater.unused_data and len(out) <= limit
        ):
            rest = inflater.unused_data
            inflater = zlib.decompressobj(wbits)
            out += inflater.decompress(rest, limit + 1 - len(out))
    except zlib.error as exc:
        raise InvalidInput(f"request body is not valid {name} data: {exc}") from None
    if len(out) > limit:
        raise PayloadTooLarge(f"decompressed request body is over the {limit}-byte limit")
    if not inflater.eof:
        raise InvalidInput(f"request body is not valid {name} data: it is cut short")
    if inflater.unused_data:
        raise InvalidInput(f"request body is not valid {name} data: bytes follow its end")
    return out
