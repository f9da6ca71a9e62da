"""An inference's headers: the options a request carries in them, and how its reply was served."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import (
    InvalidInput,
    shown,
)
from tailserve.transport.request import HttpRequest

Headers = list[tuple[bytes, bytes]]
Reply = tuple[int, Headers, bytes]


@dataclass(frozen=True, slots=True)
class HeaderOptions:
    """What an inference's headers ask: read once per request (`read_options`), then used by
    the early refusal, the reply memo and the inference alike."""

    deadline_ms: float | None = None  # X-Deadline-Ms
    cache_mode: str | None = None  # X-Cache-Mode
    variant: str | None = None  # X-Variant
    priority: int | None = None  # X-Priority


NO_OPTIONS = HeaderOptions()


def read_options(request: HttpRequest) -> HeaderOptions:
    """The request's deadline, cache mode, variant and priority headers; a malformed one is a
    400 that names it."""
    deadline_ms = None
    deadline = request.header(b"x-deadline-ms")
    if deadline is not None:
        try:
            deadline_ms = float(deadline)
        except ValueError:
            deadline_ms = -1.0
        if not 0 < deadline_ms < math.inf:  # (nan fails both)
            raise InvalidInput(
                f"X-Deadline-Ms must be a positive number of milliseconds (such as 50 or 2.5), "
                f"got {shown(deadline)}"
            )
    priority = None
    given = request.header(b"x-priority")
    if given is not None:
        try:
            priority = int(given)
        except ValueError:
            raise InvalidInput(
                f"X-Priority must be a whole number: 1 is the highest level, 0 the model's "
                f"default; got {shown(given)}"
            ) from None
    mode = request.header(b"x-cache-mode")
    variant = request.header(b"x-variant")
    if deadline_ms is None and priority is None and mode is None and variant is None:
        return NO_OPTIONS
    return HeaderOptions(
        deadline_ms,
        mode.decode(errors="replace") if mode is not None else None,
        variant.decode(errors="replace") if variant is not None else None,
        priority,
    )


def request_options(request: HttpRequest, infer: InferRequest, options: HeaderOptions) -> None:
    """Arrival time, and the options the headers asked (`read_options`), onto the engine's
    request."""
    infer.received_at = request.received_at
    if options is NO_OPTIONS:
        return
    if options.deadline_ms is not None:
        infer.deadline_ms = options.deadline_ms
    if options.cache_mode is not None:
        infer.cache_mode = options.cache_mode
    if options.variant is not None:
        infer.variant = options.variant
    if options.priority is not None:
        infer.priority = options.priority


def served_headers(response: InferResponse) -> Headers:
    """How the request was served, as headers (v2 carries it in `parameters` as well)."""
    params = response.parameters
    return [
        (b"x-model-version", response.version.encode()),
        (b"x-queue-us", str(params["queue_us"]).encode()),
        (b"x-compute-us", str(params["compute_us"]).encode()),
        (b"x-batch-size", str(params["batch_size"]).encode()),
        (b"x-cost-class", str(params["cost_class"]).encode()),
        *([(b"x-cache", params["cache"].encode())] if "cache" in params else []),
        *([(b"x-variant", params["variant"].encode())] if "variant" in params else []),
        *([(b"x-degraded", params["degraded"].encode())] if "degraded" in params else []),
    ]
