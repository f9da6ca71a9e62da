"""wrk2 (a C open-loop generator: each latency counts from the request's intended send time) as
the benchmarks drive it: churn requests with unique inputs, the replies counted by status.

wrk2 is not packaged: build it once from the public giltene/wrk2 source (`make` in its tree;
it needs a C compiler, libssl-dev and zlib1g-dev) and put the binary on the PATH as `wrk2`, or
name it with WRK2=/path/to/wrk.

wrk2 spends its first 10 s (plus 5 ms a connection of a thread) calibrating, then resets its
latency histogram: every run here lasts that long plus the measured seconds, and the script
counts statuses only in the measured window, so counts and latencies describe the same span.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_MS = 10_000

# What every workload shares: a clock, the threads' counts of statuses once their calibration is
# over (summed in done()), and the optional arguments: the model's variant to pin (X-Variant)
# and another model's name. {workload} is the request's own part: `path` and `request()`. A 200
# with an `x-degraded` header (a pipeline's step degraded: `FUNNEL`) is counted as degraded too.
_FRAME = r"""
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } timespec_t;
int clock_gettime(int clock, timespec_t *t);
]]
local ts = ffi.new("timespec_t")
local function now_ms()
  ffi.C.clock_gettime(1, ts)
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local threads = {}
function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

local headers = {["Content-Type"] = "application/json"}
{workload}
function init(args)
  math.randomseed(tonumber(id) * 7919 + os.time())
  local started = now_ms()
  counting_from = started + tonumber(args[1])
  counting_until = started + tonumber(args[2])
  ok, refused, unavailable, other, degraded = 0, 0, 0, 0, 0
  -- (optional) the model's variant to pin, and another model's name
  if args[3] and args[3] ~= "" then headers["X-Variant"] = args[3] end
  if args[4] and args[4] ~= "" then path = "/v2/models/" .. args[4] .. "/infer" end
end

function response(status, headers, body)
  local t = now_ms()
  if t < counting_from or t >= counting_until then return end
  if status == 200 then
    ok = ok + 1
    if headers["x-degraded"] or headers["X-Degraded"] then degraded = degraded + 1 end
  elseif status == 429 then refused = refused + 1
  elseif status == 503 then unavailable = unavailable + 1
  else other = other + 1 end
end

function done(summary, latency, requests)
  local t = {0, 0, 0, 0, 0}
  for _, thread in ipairs(threads) do
    t[1] = t[1] + thread:get("ok")
    t[2] = t[2] + thread:get("refused")
    t[3] = t[3] + thread:get("unavailable")
    t[4] = t[4] + thread:get("other")
    t[5] = t[5] + thread:get("degraded")
  end
  io.write(string.format("STATUSES ok=%d refused=%d unavailable=%d other=%d degraded=%d\n",
    t[1], t[2], t[3], t[4], t[5]))
end
"""


def _script(workload: str) -> str:
    return _FRAME.replace("{workload}", workload)


# A churn row as Lua: `churn_body()` is one customer drawn at random (the monthly spend a
# random double, so every body is unique), OIP v2 JSON. Shared by the churn workloads.
CHURN_BODY = r"""
local contracts = {"monthly", "annual", "multi-year"}
local tiers = {"starter", "growth", "enterprise"}
local fmt = '{"inputs":['
  .. '{"name":"tenure_months","datatype":"INT64","shape":[1,1],"data":[%d]},'
  .. '{"name":"monthly_spend","datatype":"FP32","shape":[1,1],"data":[%.6f]},'
  .. '{"name":"support_tickets","datatype":"INT64","shape":[1,1],"data":[%d]},'
  .. '{"name":"feature_usage_pct","datatype":"FP32","shape":[1,1],"data":[%.4f]},'
  .. '{"name":"last_login_days_ago","datatype":"INT64","shape":[1,1],"data":[%d]},'
  .. '{"name":"num_integrations","datatype":"INT64","shape":[1,1],"data":[%d]},'
  .. '{"name":"contract_type","datatype":"BYTES","shape":[1,1],"data":["%s"]},'
  .. '{"name":"plan_tier","datatype":"BYTES","shape":[1,1],"data":["%s"]},'
  .. '{"name":"is_enterprise","datatype":"INT64","shape":[1,1],"data":[%d]}]}'

function churn_body()
  return string.format(fmt, math.random(1, 120), math.random() * 400,
    math.random(0, 50), math.random(), math.random(0, 365), math.random(0, 50),
    contracts[math.random(1, 3)], tiers[math.random(1, 3)], math.random(0, 1))
end
"""

# Unique churn rows.
SCRIPT = _script(
    CHURN_BODY
    + r"""
local path = "/v2/models/churn/infer"

function request()
  return wrk.format("POST", path, headers, churn_body())
end

"""
)

# Sentiment reviews: token ids 1..1999, lengths lognormal (median ~24, capped at 512), as
# `tailserve.examples.sentiment` draws them.
SENTIMENT = _script(
    r"""
local path = "/v2/models/sentiment/infer"

function request()
  local u1, u2 = math.random(), math.random()
  local normal = math.sqrt(-2 * math.log(u1 + 1e-12)) * math.cos(2 * math.pi * u2)
  local length = math.floor(math.exp(math.log(24) + 0.95 * normal) + 0.5)
  if length < 1 then length = 1 elseif length > 512 then length = 512 end
  local tokens = {}
  for i = 1, length do tokens[i] = math.random(1, 1999) end
  local body = '{"inputs":[{"name":"token_ids","datatype":"INT64","shape":[1,' .. length
    .. '],"data":[' .. table.concat(tokens, ",") .. ']}]}'
  return wrk.format("POST", path, headers, body)
end
"""
)

# The funnel pipeline (`tailserve.examples.funnel`): one user a request, drawn uniformly from
# the 100,000 (a few hot users would be answered by the ranker's result cache).
FUNNEL = _script(
    r"""
local path = "/v2/models/funnel/infer"
local fmt = '{"inputs":[{"name":"user_id","datatype":"INT64","shape":[1],"data":[%d]}]}'

function request()
  return wrk.format("POST", path, headers, string.format(fmt, math.random(0, 99999)))
end
"""
)

_SPECTRUM_LINE = re.compile(r"^\s*([\d.]+)\s+([\d.]+)\s+(\d+)\s+(?:[\d.]+|inf)\s*$")
_STATUSES = re.compile(
    r"STATUSES ok=(\d+) refused=(\d+) unavailable=(\d+) other=(\d+)(?: degraded=(\d+))?"
)
_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


@dataclass(frozen=True, slots=True)
class Run:
    """One wrk2 run's measured window."""

    rate: float
    seconds: float
    ok: int
    refused: int  # 429: the worker's admission
    unavailable: int  # 503: the front door's queue (or a worker not ready)
    other: int
    socket_errors: int
    # (latency ms, cumulative fraction), from wrk2's detailed percentile spectrum.
    spectrum: tuple[tuple[float, float], ...]
    answered: int
    total: int  # requests completed over the whole run, calibration included
    degraded: int = 0  # 200s with an x-degraded header (a pipeline's step degraded)
    # wrk2's socket errors by kind: connect, read, write, timeout
    socket_kinds: tuple[int, int, int, int] = (0, 0, 0, 0)

    def quantile(self, q: float) -> float:
        for value, fraction in self.spectrum:
            if fraction >= q:
                return value
        return self.spectrum[-1][0] if self.spectrum else float("inf")

    def within(self, slo_ms: float) -> float:
        """The share of replies (any status) that came within ``slo_ms``."""
        share = 0.0
        for value, fraction in self.spectrum:
            if value > slo_ms:
                break
            share = fraction
        return share

    @property
    def errors(self) -> int:
        return self.refused + self.unavailable + self.other + self.socket_errors

    def goodput(self, slo_ms: float) -> float:
        """200s within the SLO a second, at least: the replies within the SLO less every one
        that was not a 200 (as if each of those had been fast)."""
        if not self.seconds:
            return 0.0
        good = self.answered * self.within(slo_ms) - (self.refused + self.unavailable + self.other)
        return max(0.0, min(good, self.ok)) / self.seconds

    def passes(self, slo_ms: float) -> bool:
        return self.errors == 0 and self.answered > 0 and self.quantile(0.99) <= slo_ms


def calibration_s(connections: int, threads: int = 2) -> float:
    """How long a run calibrates before its measured window begins."""
    threads = max(1, min(threads, connections))
    return (CALIBRATION_MS + (connections // threads) * 5) / 1000


def binary() -> str:
    found = os.environ.get("WRK2") or shutil.which("wrk2")
    if not found:
        raise SystemExit(
            "wrk2 is not on the PATH: build it from the giltene/wrk2 source (make) and put the "
            "binary on the PATH as wrk2, or set WRK2=/path/to/wrk"
        )
    return found


def run(
    url: str,
    rate: float,
    seconds: float,
    connections: int,
    threads: int = 2,
    count: tuple[float, float] | None = None,
    *,
    script: str = "",
    variant: str = "",
    model: str = "",
) -> Run:
    """``rate`` req/s of unique churn rows at ``url`` for ``seconds`` measured seconds.

    ``count``: the span (ms from the start) whose replies are counted by status, if not the
    measured window (the latencies are always the window's). ``script``: another workload's
    Lua (the same counting, e.g. `SENTIMENT`); ``variant``: pinned with X-Variant;
    ``model``: another model's path."""
    threads = max(1, min(threads, connections))
    calibration_ms = calibration_s(connections, threads) * 1000
    duration = math.ceil(calibration_ms / 1000 + seconds)
    seconds = duration - calibration_ms / 1000  # what is measured, whole seconds of run
    with tempfile.TemporaryDirectory() as tmp:
        lua = Path(tmp) / "workload.lua"
        lua.write_text(script or SCRIPT)
        command = [
            binary(),
            f"-t{threads}",
            f"-c{connections}",
            f"-d{duration}s",
            f"-R{max(1, round(rate))}",
            "--latency",
            "--timeout",
            "10s",
            "-s",
            str(lua),
            url,
            "--",
            *(str(round(t)) for t in (count or (calibration_ms, 1e12))),
            variant,
            model,
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk2 failed ({done.returncode}): {done.stderr.strip()}")
    return parse(done.stdout, rate, seconds)


def parse(output: str, rate: float, seconds: float) -> Run:
    spectrum: list[tuple[float, float]] = []
    answered = 0
    in_spectrum = False
    for line in output.splitlines():
        if "Detailed Percentile spectrum" in line:
            in_spectrum = True
            continue
        if in_spectrum:
            match = _SPECTRUM_LINE.match(line)
            if match:
                spectrum.append((float(match[1]), float(match[2])))
                answered = int(match[3])
            elif line.startswith("#[Mean"):
                in_spectrum = False
    statuses = _STATUSES.search(output)
    if statuses is None:
        raise RuntimeError(f"wrk2's output has no status counts:\n{output}")
    errors = _ERRORS.search(output)
    socket_errors = sum(int(g) for g in errors.groups()) if errors else 0
    ok, refused, unavailable, other = (int(g) for g in statuses.groups()[:4])
    total = re.search(r"(\d+) requests in", output)
    return Run(
        rate,
        seconds,
        ok,
        refused,
        unavailable,
        other,
        socket_errors,
        tuple(spectrum),
        answered,
        int(total[1]) if total else 0,
        int(statuses[5] or 0),
        tuple(int(g) for g in errors.groups()) if errors else (0, 0, 0, 0),  # type: ignore[arg-type]
    )


def slo_capacity(
    url: str, seconds: float, slo_ms: float, start_rps: float = 3000.0, **workload: str
) -> float:
    """The highest rate whose p99 stays within ``slo_ms`` with no errors (churn, or
    ``workload``'s `run` arguments; 64 connections, fewer below 256 req/s: at least four
    requests a second on each, wrk2's pacing being coarse below that), searched run by run;
    each run printed."""
    from tailserve.loadgen.capacity import CapacitySearch, Step

    search = CapacitySearch(slo_ms, start_rps=start_rps, precision=0.1)
    while (rate := search.next_rate()) is not None:
        connections = max(2, min(64, int(rate // 4)))
        found = run(url, rate, seconds, connections=connections, **workload)
        achieved = found.answered / found.seconds if found.seconds else 0.0
        why = ""
        if found.errors:
            why = (
                f" (429 {found.refused}, 503 {found.unavailable}, other {found.other}, "
                f"socket {found.socket_errors})"
            )
        p99 = found.quantile(0.99)
        print(f"  {rate:8.0f} req/s: p99 {p99:8.2f} ms, errors {found.errors}{why}")
        search.record(Step(rate, achieved, found.quantile(0.99), found.errors))
    return search.capacity_rps or 0.0
