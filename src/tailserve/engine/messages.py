"""Requests and responses as the engine sees them, whatever protocol carried them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tailserve.engine.validation import Checked, InputPlan
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
    # Options the transport carried beside the OIP parameters (HTTP headers, the gRPC
    # deadline): budget, priority and cache mode (`engine.options`).
    deadline_ms: float | None = None
    priority: int | None = None
    cache_mode: str | None = None
    variant: str | None = None  # the model's variant asked for by name (X-Variant)
    # Sent by a pipeline's step from inside the worker (engine/pipeline.py), not a client.
    inner: bool = False
    # The inputs as already checked against a model version's plan, by a decoder made from
    # it (protocols/http/oip_typed.py): the data plane checks them again only for another plan.
    checked: tuple[InputPlan, Checked] | None = None


@dataclass(slots=True)
class InferResponse:
    model: str
    version: str
    outputs: list[Tensor]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
