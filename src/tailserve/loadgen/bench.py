"""`tailserve bench`: run a workload open-loop and make its result document.

One run sends the workload's schedule. ``rates`` runs it at each of several offered rates in
turn (a load curve); ``find_capacity`` searches for the SLO capacity (`loadgen.capacity`). Each
step of a curve or search gets its own seed (arrivals and key draws), while a key keeps its
inputs: with unique keys no step repeats another's inputs (a result cache cannot flatter the
later steps), with Zipf keys the popular ones come back as the same requests.

With ``processes > 1`` the schedule is split between that many generator processes (each
sends every n-th request) that start on one shared instant; their samples are merged.
"""

from __future__ import annotations

import multiprocessing
import queue
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import msgspec
import orjson
import yaml

from tailserve.errors import ConfigError
from tailserve.loadgen.capacity import CapacitySearch, Step
from tailserve.loadgen.plan import Plan, build_plan
from tailserve.loadgen.progress import Progress
from tailserve.loadgen.runner import Runner, Samples, Tick
from tailserve.loadgen.sending import Link
from tailserve.loadgen.stats import generator_account, summarize
from tailserve.loadgen.timer import fine_timer_available
from tailserve.loadgen.workload import Schedule, Workload, parse_workload
from tailserve.process.collector import freeze_held
from tailserve.process.loops import run as run_loop

# Generator processes start together this long after the slowest has built its plan.
_START_LEAD_S = 0.2
_STEP_SEED = 1000


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    grpc: bool = False

    @classmethod
    def of(cls, workload: Workload) -> Target:
        return cls.parse(workload.target, grpc=workload.over_grpc)

    @classmethod
    def parse(cls, url: str, *, grpc: bool = False) -> Target:
        """An HTTP target (``http://host:port``) or a gRPC one (``host:port``)."""
        scheme = "grpc" if grpc else "http"
        parts = urllib.parse.urlsplit(url if "://" in url else f"{scheme}://{url}")
        if parts.scheme != scheme:
            wanted = "host:port" if grpc else "an http:// URL"
            over = "gRPC" if grpc else "HTTP"
            raise ConfigError(f"target {url!r}: over {over}, a target is {wanted}")
        if not parts.hostname or (grpc and parts.port is None):
            raise ConfigError(f"target {url!r} names no host{' and port' if grpc else ''}")
        return cls(parts.hostname, parts.port or 80, grpc)

    @property
    def url(self) -> str:
        return f"{'grpc' if self.grpc else 'http'}://{self.host}:{self.port}"


def link_for(workload: Workload, target: Target) -> Link:
    """How the workload's requests travel to ``target`` (`loadgen.sending`)."""
    options = workload.options
    unary = workload.protocol == "grpc"
    return Link(
        protocol="http" if not workload.over_grpc else "grpc" if unary else "grpc-stream",
        host=target.host,
        port=target.port,
        timeout_s=options.timeout_s,
        connections=workload.grpc.channels if workload.over_grpc else workload.connections,
        streams=workload.grpc.streams,
        metadata=tuple((name.lower(), value) for name, value in options.headers.items())
        if workload.over_grpc
        else (),
        deadline_s=options.deadline_ms / 1000.0 if unary and options.deadline_ms else None,
    )


def run_bench(
    workload: Workload,
    *,
    name: str | None = None,
    rates: list[float] | None = None,
    find_capacity: bool = False,
    capacity_precision: float = 0.05,
    progress: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Run the workload (once, over ``rates``, or in a capacity search); the result document."""
    target = Target.of(workload)
    model_config = None if workload.schedule.kind == "trace" else load_model_config(workload)
    document: dict[str, Any] = {
        "name": name or workload.name,
        "target": target.url,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "workload": msgspec.to_builtins(workload),
        "steps": [],
        "capacity": None,
    }
    if not rates and not find_capacity:
        document.update(run_step(workload, model_config, target, progress))
        return document
    slo = workload.slo.p99_ms
    search = CapacitySearch(
        slo_ms=slo, start_rps=workload.schedule.rate, precision=capacity_precision
    )
    results: list[tuple[float, dict[str, Any]]] = []
    index = 0
    while True:
        if rates:
            if index >= len(rates):
                break
            rate: float | None = rates[index]
        else:
            rate = search.next_rate()
        if rate is None:
            break
        step_workload = at_rate(workload, rate, seed=workload.seed + _STEP_SEED * (index + 1))
        if progress is not None:
            print(f"step {index + 1}: {rate:g} req/s", file=progress)
        result = run_step(step_workload, model_config, target, progress)
        step = Step.of(rate, result)
        search.record(step)
        passed = step.passes(slo, search.min_achieved)
        document["steps"].append(
            {**result["overall"], "rate": rate, "passes": passed, "behind": step.behind}
        )
        results.append((rate, result))
        index += 1
    passing = [
        (rate, r) for (rate, r), s in zip(results, document["steps"], strict=True) if s["passes"]
    ]
    best = max(passing, key=lambda item: item[0]) if passing else results[-1]
    document.update(best[1])
    document["capacity"] = {
        "slo_p99_ms": slo,
        "rps": best[0] if passing else None,
    }
    return document


def at_rate(workload: Workload, rate: float, *, seed: int) -> Workload:
    """The workload at one offered rate (Poisson unless it asked for constant arrivals)."""
    constant = workload.schedule.kind == "constant"
    schedule = Schedule(kind="constant" if constant else "poisson", rate=rate)
    input_seed = workload.input_seed if workload.input_seed is not None else workload.seed
    return workload.with_overrides(schedule=schedule, seed=seed, input_seed=input_seed)


def run_step(
    workload: Workload,
    model_config: dict[str, Any] | None,
    target: Target,
    progress: TextIO | None,
) -> dict[str, Any]:
    """One run of the schedule: the stats, the server's account and the generator's."""
    host = f"{target.host}:{target.port}"
    slo = workload.slo.p99_ms
    if workload.processes == 1:
        plan = build_plan(workload, model_config, host)
        printer = Progress(plan, slo, progress) if progress is not None else None
        runner = Runner(
            plan,
            link_for(workload, target),
            on_tick=printer.add if printer else None,
            fine_timer=workload.timer == "fine",
        )
        # The plan leaves the collector's reach: a full collection over it (13 ms) stalled
        # the sender, and counted against the server.
        freeze_held()
        started = time.monotonic()
        samples = _run(runner)
        wall = time.monotonic() - started
        cpu_s = runner.cpu_s
        if printer is not None:
            printer.finish()
    else:
        plan, samples, cpu_s, wall = _run_processes(workload, model_config, target, progress)
    result = summarize(
        samples, class_names=plan.class_names, warmup_s=plan.warmup_s, end_s=plan.end_s, slo_ms=slo
    )
    result["generator"] = generator_account(
        samples, slo_ms=slo, cpu_s=cpu_s, wall_s=wall, processes=workload.processes
    )
    fine = workload.timer == "fine" and fine_timer_available()
    result["generator"]["timer"] = "fine" if fine else "loop"
    return result


def _run(runner: Runner, start_at: float | None = None) -> Samples:
    return run_loop(runner.run(start_at))


# --- several generator processes ------------------------------------------------------------


def _run_processes(
    workload: Workload,
    model_config: dict[str, Any] | None,
    target: Target,
    progress: TextIO | None,
) -> tuple[Plan, Samples, float, float]:
    count = workload.processes
    context = multiprocessing.get_context("spawn")
    messages: Any = context.Queue()
    go = context.Event()
    start_at = context.Value("d", 0.0)
    raw = msgspec.to_builtins(workload)
    children = []
    for index in range(count):
        args = (raw, model_config, target, index, count, messages, go, start_at)
        children.append(
            context.Process(target=_child, args=args, name=f"bench-{index}", daemon=True)
        )
    for child in children:
        child.start()
    try:
        return _gather(workload, model_config, target, children, messages, go, start_at, progress)
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()


def _gather(
    workload: Workload,
    model_config: dict[str, Any] | None,
    target: Target,
    children: list[Any],
    messages: Any,
    go: Any,
    start_at: Any,
    progress: TextIO | None,
) -> tuple[Plan, Samples, float, float]:
    count = len(children)
    ready = 0
    parts: dict[int, Samples] = {}
    cpu_total = 0.0
    plan = build_plan(workload, model_config, f"{target.host}:{target.port}")
    printer = Progress(plan, workload.slo.p99_ms, progress) if progress is not None else None
    limit = plan.end_s + workload.options.timeout_s + 120.0
    began = time.monotonic()
    started = began
    while len(parts) < count:
        try:
            message = messages.get(timeout=1.0)
        except queue.Empty:
            dead = [c.name for c in children if not c.is_alive() and c.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"generator process {dead[0]} died") from None
            if time.monotonic() - began > limit:
                raise RuntimeError("generator processes did not finish in time") from None
            continue
        kind, index, payload = message
        if kind == "ready":
            ready += 1
            if ready == count:
                # time.monotonic() is the machine's one monotonic clock: shared by processes.
                started = time.monotonic() + _START_LEAD_S
                start_at.value = started
                go.set()
        elif kind == "tick" and printer is not None:
            printer.add(payload, source=index)
        elif kind == "done":
            samples, cpu_s = payload
            parts[index] = samples
            cpu_total += cpu_s
        elif kind == "error":
            raise RuntimeError(f"generator process {index}: {payload}")
    wall = time.monotonic() - started
    if printer is not None:
        printer.finish()
    return plan, Samples.merge([parts[i] for i in range(count)]), cpu_total, wall


def _child(
    raw: dict[str, Any],
    model_config: dict[str, Any] | None,
    target: Target,
    index: int,
    count: int,
    messages: Any,
    go: Any,
    start_at: Any,
) -> None:
    try:
        workload = parse_workload(raw, source="workload")
        plan = build_plan(workload, model_config, f"{target.host}:{target.port}")
        plan = plan.share(index, count)

        def tick(report: Tick) -> None:
            messages.put(("tick", index, report))

        runner = Runner(
            plan,
            link_for(workload, target),
            on_tick=tick,
            fine_timer=workload.timer == "fine",
        )
        freeze_held()
        messages.put(("ready", index, None))
        go.wait()
        samples = _run(runner, start_at=start_at.value)
        messages.put(("done", index, (samples, runner.cpu_s)))
    except Exception as exc:  # reported to the parent, which fails the run
        messages.put(("error", index, f"{type(exc).__name__}: {exc}"))


# --- the model's inputs ---------------------------------------------------------------------


def load_model_config(workload: Workload) -> dict[str, Any]:
    """The model's configuration: the workload's ``model_config`` (file or URL), else the
    target's ``GET /v2/models/{model}/config``."""
    source = workload.model_config
    if source is None and workload.over_grpc:
        raise ConfigError(
            "over gRPC, name the model's configuration in 'model_config' (or --model-config): "
            "its model.yaml, or a worker's http://HOST:PORT/v2/models/MODEL/config"
        )
    if source is None:
        source = f"{Target.of(workload).url}/v2/models/{workload.model}/config"
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=10) as response:
                config: Any = orjson.loads(response.read())
        except (urllib.error.URLError, OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(
                f"cannot read the model's configuration from {source}: {exc} (is the server up? "
                "set 'model_config' in the workload to read it from a model.yaml instead)"
            ) from None
    else:
        try:
            config = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read the model's configuration {source}: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("inputs"), list):
        raise ConfigError(f"{source}: not a model configuration (no 'inputs' list)")
    return config
