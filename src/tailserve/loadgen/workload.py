"""Workload files: what `tailserve bench` sends, to whom, on what schedule, against what SLO.

```yaml
name: churn-unique
target: http://127.0.0.1:8080  # gRPC: host:port
protocol: v2-json            # v2-json | v2-binary | v1-records (HTTP) | grpc | grpc-stream
model: churn
keys: {space: unique}        # unique | uniform | zipf (size, s): how often inputs repeat
fields:                      # per-field generators; fields not named are drawn from the
  monthly_spend: {lognormal: [4.2, 0.6]}   # model's own config (ranges and allowed values)
classes:                     # a mix of request shapes, by weight
  - {name: single, weight: 9, rows: 1}
  - {name: bulk, weight: 1, rows: 32}
schedule: {kind: poisson, rate: 400}  # constant | poisson | steps | ramp | trace
duration_s: 20               # measured seconds (a trace: its whole span unless set)
warmup_s: 3                  # sent first, not measured
slo: {p99_ms: 50}
options: {deadline_ms: 100, priority: 1, cache: use, headers: {x-tenant: a}}
processes: 1                 # generator processes sharing the schedule
connections: 1024            # HTTP: keep-alive connections a process may open
grpc: {channels: 1, streams: 1}  # gRPC: HTTP/2 connections a process opens; grpc-stream:
                                 # bidirectional streams a process keeps (over the channels)
timer: fine                  # fine (a timerfd, microseconds) | loop (the event loop's, 1 ms)
model_config: churn/model.yaml   # where the inputs are described (default: the target's
                                 # GET /v2/models/{model}/config); a file or a URL
```

A trace replay (``schedule: {kind: trace, trace: requests.jsonl, speed: 1.0}``) sends the
recorded requests, paths and bodies at the recorded times (divided by ``speed``); ``model`` and
``fields`` are then not needed. A trace replays over HTTP only.

``grpc`` sends OIP ``ModelInfer`` calls, ``grpc-stream`` ``ModelStreamInfer`` streams with many
requests in flight on each; both carry their inputs in ``raw_input_contents``, as ``v2-binary``
carries them over HTTP (`loadgen.grpc_sender`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from tailserve.errors import ConfigError, field_message

Protocol = Literal["v2-json", "v2-binary", "v1-records", "grpc", "grpc-stream"]
GRPC_PROTOCOLS = ("grpc", "grpc-stream")
TimerKind = Literal["fine", "loop"]
DEFAULT_DURATION_S = 20.0


class KeySpace(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # unique: every request's inputs differ; uniform/zipf: drawn from `size` distinct inputs.
    space: Literal["unique", "uniform", "zipf"] = "unique"
    size: int = 10_000
    s: float = 1.1


class RequestClass(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str = "default"
    weight: float = 1.0
    rows: int = 1


class Schedule(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    kind: Literal["constant", "poisson", "steps", "ramp", "trace"] = "poisson"
    rate: float = 100.0
    # steps: [[rate, seconds], ...]; ramp: rate_from -> rate, over the duration
    steps: list[tuple[float, float]] = msgspec.field(default_factory=list)
    rate_from: float = 0.0
    trace: str | None = None
    # trace: replay this many times faster than recorded
    speed: float = 1.0


class Slo(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    p99_ms: float = 50.0


class Options(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    deadline_ms: float | None = None
    priority: int | None = None
    cache: Literal["use", "bypass", "refresh"] | None = None
    timeout_s: float = 10.0
    headers: dict[str, str] = msgspec.field(default_factory=dict)


class GrpcOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # HTTP/2 connections a generator process opens; unary calls go over them in turn. (A
    # front door may cap the calls in flight on one: HAProxy's default is 100.)
    channels: int = 1
    # grpc-stream: streams a process keeps open, requests dealt to them in turn. Through a
    # front door a stream goes to one worker: give it at least as many as there are workers.
    streams: int = 1


class Workload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str = ""
    name: str = "workload"
    target: str = "http://127.0.0.1:8080"
    protocol: Protocol = "v2-json"
    version: str | None = None
    keys: KeySpace = KeySpace()
    fields: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    classes: list[RequestClass] = msgspec.field(default_factory=lambda: [RequestClass()])
    schedule: Schedule = Schedule()
    # None: 20 s, or a trace's whole span
    duration_s: float | None = None
    warmup_s: float = 2.0
    slo: Slo = Slo()
    options: Options = Options()
    seed: int = 1
    # What each key's inputs are drawn from (default: ``seed``). The steps of a curve or a
    # capacity search change ``seed`` (new arrivals, new key draws) but keep this, so a key
    # means the same inputs in every step, as a returning customer does for a cache.
    input_seed: int | None = None
    # Enough that a server's overload reaches the server: with few, the excess would queue
    # for a connection in the generator, where no server policy can see it.
    connections: int = 1024
    grpc: GrpcOptions = GrpcOptions()
    processes: int = 1
    # What times the sends (tailserve.loadgen.timer): "loop", the event loop's millisecond
    # timers, sends Poisson arrivals in clumps and counts its own lateness; kept to compare.
    timer: TimerKind = "fine"
    model_config: str | None = None

    @property
    def over_grpc(self) -> bool:
        return self.protocol in GRPC_PROTOCOLS

    def with_overrides(self, **changes: Any) -> Workload:
        return msgspec.structs.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @property
    def measured_s(self) -> float:
        """The measured duration of a generated schedule (steps: their sum unless set)."""
        if self.duration_s is not None:
            return self.duration_s
        if self.schedule.kind == "steps":
            return float(sum(seconds for _, seconds in self.schedule.steps))
        return DEFAULT_DURATION_S


def load_workload(path: Path) -> Workload:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the workload: {exc}") from None
    return parse_workload(raw, source=str(path))


def parse_workload(raw: Any, *, source: str) -> Workload:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a workload is a mapping of fields")
    try:
        workload = msgspec.convert(raw, Workload, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {field_message(str(exc))}") from None
    _check(workload, source)
    return workload


def _check(workload: Workload, source: str) -> None:
    def fail(field: str, message: str) -> ConfigError:
        return ConfigError(f"{source}: field '{field}': {message}")

    if not workload.classes:
        raise fail("classes", "list at least one request class")
    for i, cls in enumerate(workload.classes):
        if cls.rows < 1 or cls.weight <= 0:
            raise fail(f"classes[{i}]", "rows must be >= 1 and weight > 0")
    if workload.schedule.kind != "trace" and not workload.model:
        raise fail("model", "name the model to send requests to")
    if (workload.duration_s is not None and workload.duration_s <= 0) or workload.warmup_s < 0:
        raise fail("duration_s", "must be > 0 (and warmup_s >= 0)")
    schedule = workload.schedule
    if schedule.kind == "steps" and not schedule.steps:
        raise fail("schedule.steps", "list [rate, seconds] pairs")
    if schedule.kind == "trace" and not schedule.trace:
        raise fail("schedule.trace", "name the recorded trace file")
    if schedule.speed <= 0:
        raise fail("schedule.speed", "must be > 0")
    for i, (rate, seconds) in enumerate(schedule.steps):
        if rate < 0 or seconds <= 0:
            raise fail(f"schedule.steps[{i}]", "a step is [rate >= 0, seconds > 0]")
    if schedule.kind in ("constant", "poisson", "ramp") and schedule.rate <= 0:
        raise fail("schedule.rate", "must be > 0")
    if workload.keys.size < 1:
        raise fail("keys.size", "must be >= 1")
    if workload.processes < 1 or workload.connections < 1:
        raise fail("processes", "processes and connections must be >= 1")
    if workload.grpc.channels < 1 or workload.grpc.streams < 1:
        raise fail("grpc", "channels and streams must be >= 1")
    if workload.over_grpc and schedule.kind == "trace":
        raise fail("protocol", "a trace replays its recorded HTTP requests: not over gRPC")
