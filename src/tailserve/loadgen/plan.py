"""A run's plan: every request framed and given its intended send time, before the clock starts.

Building the plan up front means the timed run only writes bytes that already exist. A plan can
be split between generator processes (`Plan.share`): each takes every n-th request, so together
they keep the schedule's arrival process.

Generated schedules start with a warm-up at the schedule's initial rate (``warmup_s``, sent but
not measured), then the schedule itself. A trace replays the recorded requests at the recorded
times; its first ``warmup_s`` seconds are the warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tailserve.errors import ConfigError
from tailserve.loadgen.inputs import fields_for, prepare
from tailserve.loadgen.schedule import Offsets, arrival_offsets, rate_at
from tailserve.loadgen.workload import Schedule, Workload
from tailserve.observability.trace_log import read_trace
from tailserve.transport.http1 import frame_request


@dataclass(frozen=True, slots=True)
class Plan:
    offsets: Offsets  # intended send time of each request, seconds from the start, ascending
    requests: list[bytes]  # each ready to send: a framed HTTP request, or a gRPC message
    classes: np.ndarray[Any, np.dtype[np.int32]]  # request class of each
    class_names: list[str]
    warmup_s: float  # requests due before this are sent but not measured
    end_s: float  # the schedule's end

    def __len__(self) -> int:
        return len(self.requests)

    def share(self, index: int, count: int) -> Plan:
        """Every ``count``-th request from ``index``: one generator process's part."""
        if count == 1:
            return self
        return Plan(
            offsets=self.offsets[index::count],
            requests=self.requests[index::count],
            classes=self.classes[index::count],
            class_names=self.class_names,
            warmup_s=self.warmup_s,
            end_s=self.end_s,
        )


def build_plan(workload: Workload, model_config: dict[str, Any] | None, host: str) -> Plan:
    if workload.schedule.kind == "trace":
        return _trace_plan(workload, host)
    if model_config is None:
        raise ConfigError(f"workload {workload.name!r}: the model's inputs are not known")
    offsets = schedule_offsets(workload)
    fields = fields_for(model_config, workload.fields)
    prepared = prepare(workload, fields, len(offsets))
    if workload.over_grpc:
        requests = [item.body for item in prepared]
    else:
        framed: dict[tuple[int, int], bytes] = {}
        requests = []
        for item in prepared:
            data = framed.get((item.cls, item.key))
            if data is None:
                data = frame_request("POST", item.path, host, item.body, item.headers)
                framed[(item.cls, item.key)] = data
            requests.append(data)
    classes = np.fromiter((item.cls for item in prepared), dtype=np.int32, count=len(prepared))
    return Plan(
        offsets=offsets,
        requests=requests,
        classes=classes,
        class_names=[cls.name for cls in workload.classes],
        warmup_s=workload.warmup_s,
        end_s=workload.warmup_s + workload.measured_s,
    )


def schedule_offsets(workload: Workload) -> Offsets:
    """Warm-up at the schedule's initial rate, then the schedule, as send offsets."""
    schedule = workload.schedule
    measured = workload.measured_s
    parts = []
    initial = rate_at(schedule, 0.0, measured)
    if workload.warmup_s > 0 and initial > 0:
        warm = Schedule(kind="constant" if schedule.kind == "constant" else "poisson", rate=initial)
        parts.append(arrival_offsets(warm, workload.warmup_s, workload.seed))
    parts.append(arrival_offsets(schedule, measured, workload.seed + 1) + workload.warmup_s)
    offsets: Offsets = np.concatenate(parts)
    return offsets


def _trace_plan(workload: Workload, host: str) -> Plan:
    path = Path(workload.schedule.trace or "")
    try:
        entries = read_trace(path)
    except OSError as exc:
        raise ConfigError(f"cannot read the trace {path}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not entries:
        raise ConfigError(f"the trace {path} holds no requests")
    start = entries[0]["t"]
    times = np.array([entry["t"] - start for entry in entries], dtype=np.float64)
    offsets: Offsets = times / workload.schedule.speed
    end = float(offsets[-1]) + 1e-6
    if workload.duration_s is not None:
        end = min(end, workload.warmup_s + workload.duration_s)
    keep = offsets < end
    names: list[str] = sorted({entry["path"] for entry in entries})
    index = {name: i for i, name in enumerate(names)}
    requests = []
    classes = []
    for entry, kept in zip(entries, keep.tolist(), strict=True):
        if not kept:
            continue
        headers = tuple(entry.get("headers", {}).items())
        requests.append(frame_request(entry["method"], entry["path"], host, entry["body"], headers))
        classes.append(index[entry["path"]])
    return Plan(
        offsets=offsets[keep],
        requests=requests,
        classes=np.array(classes, dtype=np.int32),
        class_names=names,
        warmup_s=min(workload.warmup_s, end),
        end_s=end,
    )
