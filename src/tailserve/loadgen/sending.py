"""What the open-loop runner hands its requests to: a `Sender`, one per wire protocol.

The runner decides *when* each request goes; a sender only puts it on the wire and reports,
once per request, how it ended: an outcome code and what the server said of how it served it.
`Link` names the protocol, the address and the limits of a run, and opens the matching sender
on the running loop: HTTP/1.1 over a keep-alive pool (`loadgen.http_sender`), gRPC unary calls
or gRPC bidirectional streams (`loadgen.grpc_sender`, imported only when asked for: grpcio is
an optional dependency).

Outcome codes are HTTP statuses where there is one: a gRPC OK counts as 200 and another gRPC
status as ``GRPC_BASE`` plus its number; negative codes are requests that got no answer
(``TIMEOUT``, ``CONNECT``, ``LOST``) or got a stream's ``error_message`` (``STREAM_ERROR``).
`ERROR_KINDS` names them in reports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

OK = 200
TIMEOUT, CONNECT, LOST, STREAM_ERROR = -1, -2, -3, -4
GRPC_BASE = 1000
_GRPC_NAMES = (
    "ok",
    "cancelled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
)
ERROR_KINDS = {
    TIMEOUT: "timeout",
    CONNECT: "connection",
    LOST: "connection",
    STREAM_ERROR: "stream_error",
    **{GRPC_BASE + code: f"grpc_{name}" for code, name in enumerate(_GRPC_NAMES) if code},
}
CACHE_TIERS = ("", "miss", "l1", "l2", "stale", "coalesced", "precomputed")
CACHE_CODES = {tier: code for code, tier in enumerate(CACHE_TIERS) if tier}


@dataclass(frozen=True, slots=True)
class Served:
    """How the server said it served a request (-1 / 0 where it did not say)."""

    queue_us: int = -1
    compute_us: int = -1
    batch_size: int = -1
    cache: int = 0  # index into CACHE_TIERS


# (request index, outcome code, the server's account or None): called once per request.
Completion = Callable[[int, int, Served | None], None]


class Sender(Protocol):
    def send(self, index: int, data: bytes) -> None:
        """Put request ``index`` (its prepared bytes) on the wire now; never wait for it."""

    async def close(self) -> None:
        """Stop; requests still out are not reported (the runner counts them lost)."""


WireProtocol = Literal["http", "grpc", "grpc-stream"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """Where and how one generator process sends its requests."""

    protocol: WireProtocol
    host: str
    port: int
    timeout_s: float
    # HTTP: keep-alive connections; gRPC: HTTP/2 connections (channels), calls spread over them.
    connections: int = 1
    # grpc-stream: bidirectional streams, requests spread over them (and they over channels).
    streams: int = 1
    # gRPC: sent as metadata (HTTP: framed into the requests' headers by the plan).
    metadata: tuple[tuple[str, str], ...] = ()
    # gRPC unary: the call's gRPC deadline (the server reads it as X-Deadline-Ms).
    deadline_s: float | None = None

    def open(self, loop: asyncio.AbstractEventLoop, done: Completion) -> Sender:
        """The sender for this link, on ``loop`` (which must be running)."""
        if self.protocol == "http":
            from tailserve.loadgen.http_sender import HttpSender

            return HttpSender(self, loop, done)
        from tailserve.loadgen.grpc_sender import StreamSender, UnarySender

        if self.protocol == "grpc":
            return UnarySender(self, loop, done)
        return StreamSender(self, loop, done)
