"""Lifecycle edges, measured from outside with C generators: the stack fails no request that
could be served when it has just said ready, while a worker restarts or joins, while it stops,
and while a worker dies under load.

1. ready: `tailserve up --workers 2` probed every 5 ms from its start; at the first 200 from
   /v2/health/ready, at once: wrk2 over HTTP (churn, unique rows), h2load over gRPC unary, a gRPC
   stream (a call every 10 ms) and job submissions (20 a second). Again right after a worker is
   SIGKILLed, and on `--min-workers 1 --max-workers 2` while a worker is added. `--full`: the
   whole example repository too. Goal: 0 non-2xx, 0 unanswered.
2. stop: `make run` under wrk2 (300 req/s, 64 connections), its group sent SIGTERM, then SIGINT;
   then a bash wrapper forwarding SIGTERM, its group sent SIGTERM (the stack sees two). Each
   request carries its send time as its OIP `id`, which the reply echoes: those sent before the
   signal and never answered are counted exactly. Goal: 0 failed, every worker exits 0.
3. failover: `tailserve up --workers 2` at 15% of one worker's SLO capacity (wrk2, 64
   connections), a worker SIGKILLed 3 s in, the load kept on `--seconds` past its restart.
   Goal: 0 refused, 0 failed.

    python benchmarks/edges.py [--only ready,stop,failover] [--seconds 10] [--full]
                               [--capacity RPS] [--runs 5]

Needs wrk2 (benchmarks/_wrk2.py), h2load (nghttp2-client) and tritonclient[grpc]. Check with `ps`
that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

import _h2load
import _wrk2
from _harness import WORKLOADS, examples, free_port, get_json, one_model, serving, wait_served
from _harness import worker as worker_command
from tailserve.examples.churn import FIELDS, sample_rows

ROOT = Path(__file__).resolve().parent.parent
SLO_MS = 50.0
HTTP_RPS, GRPC_RPS, STREAM_EVERY_S, JOB_EVERY_S = 200.0, 100.0, 0.010, 0.050
READY = re.compile(r"tailserve up: front door on .*ready")
PIDS = re.compile(r"started \(pid (\d+)\)|HAProxy pid (\d+)")
EXITED = re.compile(r"(worker-\d+) \(pid \d+\) exited with (-?\d+)")
GRPC_COUNT = re.compile(r"^tailserve_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.MULTILINE)
EDGES = re.compile(r"EDGES sent_pre=(\d+) answered_pre=(\d+) anonymous=(\d+) late_non_2xx=(\d+)")
# `tailserve up` behind a forwarding trap, as many an entrypoint script runs it.
WRAPPER = '"$@" & c=$!; trap "kill -TERM $c" TERM INT; wait $c; wait $c'
GOALS = {
    "ready": "0 non-2xx, 0 unanswered",
    "stop": "0 failed, workers exit 0",
    "failover": "0 refused, 0 failed",
}
Row = tuple[list[str], bool | None]  # a table's cells; met its goal (None: not measured)
Fleet = list[dict[str, Any]]

# Appended to `_wrk2.SCRIPT`: a request's body carries its send time (CLOCK_MONOTONIC ms, as
# Python's time.monotonic) as its `id`, which the reply echoes; args[5] is the signal's time.
# wrk2 calls the first thread's request() once to check the script, and never sends that one.
STOP_LUA = r"""
local frame_init, frame_response, frame_done = init, response, done
function init(args)
  frame_init(args)
  stop_at, checked = tonumber(args[5]), tonumber(id) ~= 1
  sent_pre, answered_pre, anonymous, late_non_2xx = 0, 0, 0, 0
end
function request()
  local t = now_ms()
  if t < stop_at and checked then sent_pre = sent_pre + 1 end
  checked = true
  local body = string.format('{"id":"%.3f",', t) .. churn_body():sub(2)
  return wrk.format("POST", path, headers, body)
end
function response(status, headers, body)
  frame_response(status, headers, body)
  if status ~= 200 and now_ms() >= stop_at then late_non_2xx = late_non_2xx + 1 end
  local sent = tonumber(string.match(body or "", '"id":"([%d.]+)"'))
  if sent == nil then anonymous = anonymous + 1
  elseif sent < stop_at then answered_pre = answered_pre + 1 end
end
function done(summary, latency, requests)
  frame_done(summary, latency, requests)
  local names, t = {"sent_pre", "answered_pre", "anonymous", "late_non_2xx"}, {0, 0, 0, 0}
  for _, thread in ipairs(threads) do
    for i, name in ipairs(names) do t[i] = t[i] + thread:get(name) end
  end
  io.write(string.format("EDGES sent_pre=%d answered_pre=%d anonymous=%d late_non_2xx=%d\n",
    t[1], t[2], t[3], t[4]))
end
"""


class Reaper:
    """Every process group this script starts, and the stack's processes (in sessions of their
    own, named in its log), killed at the end whatever happened."""

    def __init__(self) -> None:
        self.groups: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, command: list[str], log: Path, **popen: Any) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
            )
        self.groups.append((process, log))
        return process

    @staticmethod
    def leftovers(log: Path) -> list[int]:
        """The stack's processes named in ``log`` still running (by name: pids are reused)."""
        alive = []
        for match in PIDS.finditer(log.read_text(errors="replace")):
            pid = int(match[1] or match[2])
            with contextlib.suppress(OSError):
                if re.search(rb"tailserve|haproxy", Path(f"/proc/{pid}/cmdline").read_bytes()):
                    alive.append(pid)
        return alive

    def kill(self, log: Path) -> None:
        for pid in self.leftovers(log):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # each leads a session of its own

    def __enter__(self) -> Reaper:
        return self

    def __exit__(self, *exc: object) -> None:
        for process, log in self.groups:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            self.kill(log)


@dataclass(frozen=True, slots=True)
class Up:
    process: subprocess.Popen[bytes]
    url: str
    grpc: str  # host:port
    log: Path


@dataclass(frozen=True, slots=True)
class Tally:
    kind: str  # of load, over one edge
    sent: int
    non_2xx: int
    unanswered: int  # socket errors, failed streams, calls that raised
    detail: str = ""


def churn_json() -> bytes:
    row = sample_rows(1, 3)
    inputs = [
        {"name": f.name, "datatype": f.datatype, "shape": [1, 1], "data": row[f.name]}
        for f in FIELDS
    ]
    return orjson.dumps({"inputs": inputs})


def start_up(reaper: Reaper, repository: Path, work: Path, *flags: str) -> Up:
    """`tailserve up` as its own process group, from the moment it starts (not once ready)."""
    port, grpc = free_port(), free_port()
    command = [sys.executable, "-m", "tailserve.cli", "up", "--repository", str(repository)]
    command += ["--port", str(port), "--grpc-port", str(grpc), *flags]
    log = work / f"up-{port}.log"
    return Up(reaper.start(command, log), f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc}", log)


def stop_up(reaper: Reaper, up: Up) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(up.process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        up.process.wait(timeout=60)
    reaper.kill(up.log)


def first_ready(up: Up, timeout: float = 180.0) -> float:
    """Probe the front door's ready route every 5 ms; the seconds until its first 200."""
    start = time.monotonic()
    while time.monotonic() - start < timeout and up.process.poll() is None:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{up.url}/v2/health/ready", timeout=1) as reply,
        ):
            if reply.status == 200:
                return time.monotonic() - start
        time.sleep(0.005)
    raise RuntimeError(f"{up.url} never said ready ({up.process.poll()}):\n{log_tail(up.log)}")


def log_tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-20:])


def until_fleet(url: str, done: Callable[[Fleet], bool], stop: threading.Event) -> float:
    """Seconds until ``done`` holds of /v2/fleet's workers (NaN: not before ``stop``)."""
    start = time.monotonic()
    while not stop.wait(0.05):
        with contextlib.suppress(OSError):
            if done(get_json(f"{url}/v2/fleet")["workers"]):
                return time.monotonic() - start
    return math.nan


def kill_worker(url: str, name: str = "worker-0") -> Callable[[Fleet], bool]:
    """SIGKILL a worker; the test of its being ready again in a new process."""
    (pid,) = [w["pid"] for w in get_json(f"{url}/v2/fleet")["workers"] if w["name"] == name]
    os.kill(pid, signal.SIGKILL)
    return lambda fleet: any(w["name"] == name and w["ready"] and w["pid"] != pid for w in fleet)


def grpc_errors(url: str) -> dict[str, float]:
    """The gRPC calls the workers answered with an error, a series each (the merged page)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        labels: float(value)
        for labels, value in GRPC_COUNT.findall(text)
        if 'protocol="grpc"' in labels and 'status="200"' not in labels
    }


def http_load(url: str, seconds: float) -> Tally:
    run = _wrk2.run(url, HTTP_RPS, seconds, connections=16, count=(0, 1e12))
    connect, read, write, timeout = run.socket_kinds
    non_2xx = run.refused + run.unavailable + run.other
    detail = f"429 {run.refused}, 503 {run.unavailable}, other {run.other}; "
    detail += f"socket connect/read/write/timeout {connect}/{read}/{write}/{timeout}"
    sent = run.ok + non_2xx + read + write + timeout
    return Tally("HTTP infer (wrk2)", sent, non_2xx, sum(run.socket_kinds), detail)


def unary_load(authority: str, message: bytes, span: float) -> Tally:
    run = _h2load.run(authority, message, GRPC_RPS, span, connections=4, warmup_s=0.0)
    sent = run.answered + run.refused + run.failed
    detail = f"HTTP non-200 {run.refused}, failed streams {run.failed}"
    if sent < 0.95 * GRPC_RPS * span:  # h2load does not connect again after a GOAWAY
        detail += f"; sent {sent} of {GRPC_RPS * span:.0f}: its connections ended early"
    return Tally("gRPC unary (h2load)", sent, run.refused, run.failed, detail)


def stream_load(authority: str, span: float) -> Tally:
    """A call every 10 ms on one gRPC stream (started again if it breaks, as a client would)."""
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException, triton_to_np_dtype

    row, inputs = sample_rows(1, 3), []
    for f in FIELDS:
        inputs.append(triton.InferInput(f.name, [1, 1], f.datatype))
        dtype = triton_to_np_dtype(f.datatype)
        inputs[-1].set_data_from_numpy(np.asarray(row[f.name], dtype=dtype).reshape(1, 1))
    counts, lock = {"ok": 0, "error": 0}, threading.Lock()

    def answered(result: Any, error: Any) -> None:
        with lock:
            counts["error" if error is not None else "ok"] += 1

    client, sent, raised, start = triton.InferenceServerClient(authority), 0, 0, time.monotonic()
    try:
        client.start_stream(callback=answered)
        while time.monotonic() < start + span:
            sent += 1
            try:
                client.async_stream_infer("churn", inputs)
            except InferenceServerException:
                raised += 1
                client.stop_stream()
                client.start_stream(callback=answered)
            time.sleep(max(0.0, start + sent * STREAM_EVERY_S - time.monotonic()))
        deadline = time.monotonic() + 10  # the last answers
        while sum(counts.values()) + raised < sent and time.monotonic() < deadline:
            time.sleep(0.01)
        client.stop_stream()
    finally:
        client.close()
    unanswered, detail = sent - sum(counts.values()) - raised, f"raised {raised}"
    return Tally("gRPC stream", sent, counts["error"] + raised, unanswered, detail)


def jobs_load(url: str, span: float) -> Tally:
    """A job submission every 50 ms; each should be a 202."""
    body, headers, statuses = churn_json(), {"Content-Type": "application/json"}, dict[int, int]()
    sent, start = 0, time.monotonic()
    while time.monotonic() < start + span:
        request = urllib.request.Request(f"{url}/v2/models/churn/jobs", body, headers)
        sent += 1
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                status = reply.status
        except urllib.error.HTTPError as error:
            status = error.code
        except OSError:
            status = 0  # no answer
        statuses[status] = statuses.get(status, 0) + 1
        time.sleep(max(0.0, start + sent * JOB_EVERY_S - time.monotonic()))
    refused = sum(n for s, n in statuses.items() if s not in (0, 202))
    detail = ", ".join(f"{s or 'no answer'}: {n}" for s, n in sorted(statuses.items()))
    return Tally("jobs (POST, 202)", sent, refused, statuses.get(0, 0), detail)


def edge_loads(
    up: Up, message: bytes, seconds: float, before: dict[str, float] | None = None
) -> list[Tally]:
    """The four kinds of load at once, for as long as wrk2 runs (calibration + ``seconds``), and
    the growth of the workers' own count of gRPC errors (h2load cannot see a gRPC status) from
    ``before`` (none: a fresh stack)."""
    span, before = math.ceil(_wrk2.calibration_s(16) + seconds), before or {}
    with ThreadPoolExecutor(4) as pool:
        loads = [
            pool.submit(http_load, up.url, seconds),
            pool.submit(unary_load, up.grpc, message, span),
            pool.submit(stream_load, up.grpc, span),
            pool.submit(jobs_load, up.url, span),
        ]
        tallies = [load.result() for load in loads]
    # a restarted worker's counter starts again from 0
    grown = sum(v - min(v, before.get(k, 0.0)) for k, v in grpc_errors(up.url).items())
    return [*tallies, Tally("gRPC errors, workers' count", 0, round(grown), 0, "unary + stream")]


def edge_under_load(
    up: Up,
    message: bytes,
    seconds: float,
    done: Callable[[Fleet], bool],
    before: dict[str, float] | None = None,
) -> tuple[list[Tally], float]:
    """The loads, and meanwhile the seconds until ``done`` holds of the fleet."""
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        when = pool.submit(until_fleet, up.url, done, stop)
        try:
            loads = edge_loads(up, message, seconds, before)
        finally:
            stop.set()
    return loads, when.result()


def serving_two(fleet: Fleet) -> bool:
    return sum(bool(w["ready"] and w["state"] == "serving") for w in fleet) >= 2


def ready(args: argparse.Namespace, reaper: Reaper, work: Path, every: Path) -> list[Row]:
    churn = one_model(every / "churn", work / "churn-ready", cache={})
    message = _h2load.infer_message(WORKLOADS / "churn-unique.yaml", churn / "churn/model.yaml")
    edges: list[tuple[str, list[Tally]]] = []
    for name, repository in [("churn", churn), *([("full", every)] if args.full else [])]:
        up = start_up(reaper, repository, work, "--workers", "2")
        took = first_ready(up)
        loads = edge_loads(up, message, args.seconds)
        edges.append((f"{name}: first ready, {took:.2f} s after start", loads))
        before = grpc_errors(up.url)  # then the kill, then at once the loads
        loads, back = edge_under_load(up, message, args.seconds, kill_worker(up.url), before)
        edges.append((f"{name}: worker-0 SIGKILLed, ready again in {back:.2f} s", loads))
        stop_up(reaper, up)
    # The autoscaler adds a worker when the requests in flight exceed what one should carry: a
    # tiny target makes the edge loads themselves the trigger.
    scaling = ["--min-workers", "1", "--max-workers", "2", "--target-in-flight", "0.1"]
    up = start_up(reaper, churn, work, *scaling)
    first_ready(up)
    loads, grew = edge_under_load(up, message, args.seconds, serving_two)
    stop_up(reaper, up)
    scaled = f"churn: scale-up 1 -> 2, second worker serving {grew:.1f} s in"
    edges.append(("churn: scale-up", []) if math.isnan(grew) else (scaled, loads))
    rows: list[Row] = []
    for edge, tallies in edges:
        for t in tallies:
            cells = [edge, t.kind, f"{t.sent:,}", str(t.non_2xx), str(t.unanswered), t.detail]
            rows.append((cells, t.non_2xx + t.unanswered == 0))
        if not tallies:
            why = "NOT MEASURED: the autoscaler added no worker while the loads ran"
            rows.append(([edge, why, "-", "-", "-", "-"], None))
    table(args, "ready", ["edge", "load", "sent", "non-2xx", "unanswered", "detail"], rows)
    verdicts = {edge: [passed for cells, passed in rows if cells[0] == edge] for edge, _ in edges}
    return [([edge], None if None in p else all(p)) for edge, p in verdicts.items()]


def stop_row(how: str, sig: signal.Signals, reaper: Reaper, work: Path, after_s: float) -> Row:
    port, grpc = free_port(), free_port()
    log, wrk_log = work / f"stop-{port}.log", work / f"wrk-{port}.log"
    command = ["make", "--no-print-directory", "run", f"PORT={port}", f"GRPC_PORT={grpc}"]
    command.append("WORKERS=2")
    if how.startswith("bash"):
        command = ["bash", "-c", WRAPPER, "bash", sys.executable, "-m", "tailserve.cli", "up"]
        command += ["--repository", "var/repository", "--port", str(port)]
        command += ["--grpc-port", str(grpc), "--workers", "2"]
    leader = reaper.start(command, log, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # make builds the examples on first use
    while not READY.search(log.read_text(errors="replace")):
        if leader.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{how}: the stack never said ready:\n{log_tail(log)}")
        time.sleep(0.1)
    wait_served(url, "churn", churn_json())
    lua = work / "stop.lua"
    lua.write_text(_wrk2.SCRIPT + STOP_LUA)
    stop_at = time.monotonic() + after_s
    load = [_wrk2.binary(), "-t2", "-c64", f"-d{math.ceil(after_s) + 600}s", "-R300"]
    load += ["--timeout", "10s", "-s", str(lua), url, "--", "0", "1e12", "", ""]
    wrk = reaper.start([*load, f"{stop_at * 1000:.3f}"], wrk_log)
    time.sleep(max(0.0, stop_at - time.monotonic()))
    os.killpg(leader.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(timeout=120)
    exit_s = time.monotonic() - stop_at if leader.returncode is not None else math.inf
    left = Reaper.leftovers(log)
    reaper.kill(log)
    time.sleep(1.0)  # wrk2 sees the last replies, then stops with its report
    wrk.send_signal(signal.SIGINT)
    wrk.wait(timeout=30)
    output = wrk_log.read_text()
    run, edges = _wrk2.parse(output, 300.0, after_s), EDGES.search(output)
    if edges is None:
        raise RuntimeError(f"wrk2's output has no EDGES line:\n{output}")
    sent_pre, answered_pre, anonymous, late = (int(g) for g in edges.groups())
    # a reply with no id (the front door's own) may answer a request sent after the signal
    unanswered = max(0, sent_pre - answered_pre - anonymous)
    non_2xx = run.refused + run.unavailable + run.other
    codes = EXITED.findall(log.read_text(errors="replace"))
    cells = [how, f"{sent_pre:,}", f"{non_2xx} ({late} after)", str(unanswered)]
    cells += [str(non_2xx + unanswered), f"{max(0, sum(run.socket_kinds) - unanswered):,}"]
    cells += [", ".join(f"{n}: {c}" for n, c in codes) or "none logged", f"{exit_s:.2f} s"]
    cells += [f"{leader.returncode}", str(len(left))]
    clean = bool(codes) and all(code == "0" for _, code in codes)
    return cells, non_2xx + unanswered == 0 and clean and not left


def stop(args: argparse.Namespace, reaper: Reaper, work: Path, every: Path) -> list[Row]:
    stops = [
        ("make run, SIGTERM to its group", signal.SIGTERM),
        ("make run, SIGINT to its group", signal.SIGINT),
        ("bash wrapper forwarding SIGTERM, SIGTERM to its group", signal.SIGTERM),
    ]
    rows = [stop_row(how, sig, reaper, work, min(args.seconds, 5.0)) for how, sig in stops]
    header = ["stop", "sent before", "non-2xx", "unanswered (sent before)", "failed"]
    header += ["socket errors after (refused reconnects)", "workers' exit codes", "exit after"]
    table(args, "stop", [*header, "leader's exit", "left running"], rows)
    print("\nA reconnect the closed listener refuses is a read or write error to wrk2.")
    return [([cells[0]], passed) for cells, passed in rows]


def capacity(args: argparse.Namespace, repository: Path) -> float:
    if args.capacity:
        return float(args.capacity)
    print("One worker's SLO capacity (p99 <= 50 ms, no error), 64 connections:", flush=True)
    port = free_port()
    with serving(worker_command(repository, port, "--grpc-port", "0"), port) as url:
        found = _wrk2.slo_capacity(url, args.step_seconds, SLO_MS, start_rps=1500.0)
    print(f"  capacity {found:,.0f} req/s", flush=True)
    return found


def failover_row(reaper: Reaper, repository: Path, work: Path, rate: float, tail: float) -> Row:
    up = start_up(reaper, repository, work, "--workers", "2")
    try:
        first_ready(up)
        wait_served(up.url, "churn", churn_json())
        kill_at, restart_s = 3.0, 4.0  # a restart takes 2-3 s on 2 cores
        measured = max(1.0, kill_at + restart_s + tail - _wrk2.calibration_s(64))
        with ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            load = pool.submit(_wrk2.run, up.url, rate, measured, 64, count=(0, 1e12))
            time.sleep(kill_at)
            back = until_fleet(up.url, kill_worker(up.url), threading.Event())
            r = load.result()
        past = time.monotonic() - start - kill_at - back
    finally:
        stop_up(reaper, up)
    connect, read, write, timeout = r.socket_kinds
    sent = r.ok + r.refused + r.unavailable + r.other + read + write + timeout
    cells = [f"{r.rate:,.0f}", f"{sent:,}", str(r.refused), str(r.unavailable), str(r.other)]
    cells += [f"{connect}/{read}/{write}/{timeout}", f"{back:.2f} s", f"{past:.1f} s"]
    return cells, r.refused + r.unavailable + r.other + sum(r.socket_kinds) == 0


def failover(args: argparse.Namespace, reaper: Reaper, work: Path, every: Path) -> list[Row]:
    churn = one_model(every / "churn", work / "churn-failover", cache={})
    rate = 0.15 * capacity(args, churn)
    runs = [failover_row(reaper, churn, work, rate, args.seconds) for _ in range(args.runs)]
    rows: list[Row] = [([str(i), *cells], passed) for i, (cells, passed) in enumerate(runs, 1)]
    header = ["run", "rate", "sent", "429", "503", "other", "socket c/r/w/t"]
    table(args, "failover", [*header, "worker back after", "load past that"], rows)
    return [([f"run {cells[0]}"], passed) for cells, passed in rows]


def verdict(passed: bool | None) -> str:
    return "not measured" if passed is None else "PASS" if passed else "FAIL"


def table(args: argparse.Namespace, section: str, header: list[str], rows: list[Row]) -> None:
    flags = f"--only {section} --seconds {args.seconds:g}"
    flags += " --full" if section == "ready" and args.full else ""
    if section == "failover":
        flags += f" --runs {args.runs}" + (
            f" --capacity {args.capacity:g}" if args.capacity else ""
        )
    print(f"\n`python benchmarks/edges.py {flags}`\n")
    print("| " + " | ".join([*header, "goal"]) + " |\n|" + " --- |" * (len(header) + 1))
    for cells, passed in rows:
        print("| " + " | ".join(cells) + f" | {verdict(passed)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="ready,stop,failover", help="sections, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds a load")
    parser.add_argument("--full", action="store_true", help="ready: the whole example repository")
    parser.add_argument("--capacity", type=float, help="failover: one worker's SLO capacity")
    parser.add_argument("--step-seconds", type=float, default=5.0, help="a capacity step")
    parser.add_argument("--runs", type=int, default=5, help="failover runs")
    args = parser.parse_args()
    sections = {"ready": ready, "stop": stop, "failover": failover}
    if unknown := set(args.only.split(",")) - set(sections):
        parser.error(f"--only: no section {', '.join(sorted(unknown))}")
    _wrk2.binary()
    _h2load.binary()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up, as after Ctrl-C
    summary: list[tuple[str, bool | None]] = []
    with tempfile.TemporaryDirectory(prefix="edges-") as tmp, Reaper() as reaper:
        every = examples(Path(tmp) / "examples")
        for name in args.only.split(","):
            rows = sections[name](args, reaper, Path(tmp), every)
            summary += [(f"{name}: {cells[0]}", passed) for cells, passed in rows]
    print("\n| check | goal | result |\n| --- | --- | --- |")
    for check, passed in summary:
        print(f"| {check} | {GOALS[check.split(':')[0]]} | {verdict(passed)} |")


if __name__ == "__main__":
    main()
