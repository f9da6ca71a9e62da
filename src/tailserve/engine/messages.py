"""Requests and responses as the engine sees them, whatever protocol carried them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailserve.tensors import Tensor


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    model: str
    inputs: list[Tensor]
    version: str | None = None
    id: str | None = None
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # When the request arrived (time.monotonic()); its deadline counts from here.
    received_at: float | None = None
    # Budget and priority from headers (X-Deadline-Ms, X-Priority); OIP parameters
    # (`timeout` in µs, `priority`) carry the same and the tighter deadline wins.
    deadline_ms: float | None = None
    priority: int | None = None
    # use | bypass | refresh, from the X-Cache-Mode header (the `cache` parameter wins).
    cache_mode: str | None = None
    # The model's shed admitted it before it was read, for the deadline of its header (or the
    # SLO) and the highest priority (`DataPlane.shed`).
    screened: bool = False


@dataclass(slots=True)
class InferResponse:
    model: str
    version: str
    outputs: list[Tensor]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # Where a fresh L1 hit came from: (the cache's `ModelView`, the key, the entry's stored
    # bytes). The HTTP layer keeps the encoded reply against it (`cache.replies`).
    origin: tuple[Any, str, bytes] | None = None
