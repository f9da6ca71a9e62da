"""An inference's headers: the options a request carries in them, and how its reply was served."""

from __future__ import annotations

import math

from tailserve.engine.messages import InferRequest, InferResponse
from tailserve.errors import (
    InvalidInput,
    shown,
)
from tailserve.protocols.http.request import HttpRequest

Headers = list[tuple[bytes, bytes]]
Reply = tuple[int, Headers, bytes]


def request_options(request: HttpRequest, infer: InferRequest) -> None:
    """Arrival time, and the deadline, priority and cache mode headers, onto the engine's
    request."""
    infer.received_at = request.received_at
    deadline = request.header(b"x-deadline-ms")
    if deadline is not None:
        try:
            infer.deadline_ms = float(deadline)
        except ValueError:
            infer.deadline_ms = -1.0
        if not 0 < infer.deadline_ms < math.inf:  # (nan fails both)
            raise InvalidInput(
                f"X-Deadline-Ms must be a positive number of milliseconds (such as 50 or 2.5), "
                f"got {shown(deadline)}"
            )
    mode = request.header(b"x-cache-mode")
    if mode is not None:
        infer.cache_mode = mode.decode(errors="replace")
    variant = request.header(b"x-variant")
    if variant is not None:
        infer.variant = variant.decode(errors="replace")
    priority = request.header(b"x-priority")
    if priority is not None:
        try:
            infer.priority = int(priority)
        except ValueError:
            raise InvalidInput(
                f"X-Priority must be a whole number: 1 is the highest level, 0 the model's "
                f"default; got {shown(priority)}"
            ) from None


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
