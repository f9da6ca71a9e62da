"""Soak: the whole stack under mixed load for a long time; memory, file descriptors and p99 flat.

    WRK2=/path/to/wrk2 python benchmarks/soak.py --minutes 30 --out var/soak

The stack as `make run REDIS_URL=...` starts it (`tailserve up`, the example repository, a
private redis-server for the L2 cache, the feature store and the jobs), then, all at once for
``--minutes``:

- wrk2 (open loop, 64 connections) at ``--wrk2-rate`` req/s of churn rows, every one unique;
- `tailserve bench` at ``--rate`` req/s of `churn-zipf` (10,000 customers, Zipf(1.1): the
  result cache's hits and misses), whose per-second timeline gives p99 over the run;
- a churn job of ``--job-rows`` rows every minute (each read back at the end);
- a reload of a model every two minutes (`POST /v2/repository/models/{m}/load`, the models
  in turn), through the admin lane as an operator would.

Every ``--sample-s`` seconds it reads each process of the stack (supervisor, workers, front
door, hedging lane, Redis): resident memory and open file descriptors, and once a minute the
stack's own p99 from its `/metrics`. It writes ``samples.json``, ``soak.png`` and
``report.md`` (the verdicts: growth of memory after the first third, descriptors at the start
and the end, p99 in the first and last five minutes) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

import _harness
import _wrk2

CHURN_ROW = {
    "tenure_months": ("INT64", 12),
    "monthly_spend": ("FP32", 80.5),
    "support_tickets": ("INT64", 2),
    "feature_usage_pct": ("FP32", 0.4),
    "last_login_days_ago": ("INT64", 3),
    "num_integrations": ("INT64", 4),
    "contract_type": ("BYTES", "annual"),
    "plan_tier": ("BYTES", "growth"),
    "is_enterprise": ("INT64", 0),
}
RELOADED = ("churn", "sentiment", "churn_lgbm")


def churn_body(rows: int) -> bytes:
    inputs = [
        {"name": name, "datatype": dtype, "shape": [rows, 1], "data": [value] * rows}
        for name, (dtype, value) in CHURN_ROW.items()
    ]
    return orjson.dumps({"inputs": inputs})


def post(url: str, body: bytes = b"{}") -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, orjson.loads(reply.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.read()[:300].decode(errors="replace")
    except OSError as error:
        return 0, str(error)


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (Linux: /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(stat[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_state(pid: int) -> tuple[str, float, int] | None:
    """(command name, resident MiB, open descriptors), or None once the process is gone."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line[:6] == "VmRSS:")
        return name, rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def names(url: str, supervisor: int) -> dict[int, str]:
    """pid -> the role the stack gives it (worker name, front door, supervisor)."""
    fleet = _harness.get_json(f"{url}/v2/fleet")
    roles = {supervisor: "supervisor"}
    roles.update({w["pid"]: w["name"] for w in fleet["workers"] if w.get("pid")})
    if fleet.get("front_door", {}).get("pid"):
        roles[fleet["front_door"]["pid"]] = "frontdoor"
    return roles


def readiness(url: str) -> dict[tuple[str, str], float]:
    """(worker, model) -> its `tailserve_model_ready`, from the stack's one /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.labels.get("worker", ""), sample.labels["model"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "tailserve_model_ready"
        for sample in family.samples
    }


def wait_loaded(url: str, timeout_s: float = 600.0) -> None:
    """Until every worker has every model loaded and warm: the stack is ready, and churn served,
    while the slower models still load and warm up (their memory is still growing)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        ready = readiness(url)
        workers = {w for w, _ in ready}
        models = {m for _, m in ready}
        whole = ready and len(ready) == len(workers) * len(models) and all(ready.values())
        if whole and ready == last:
            return
        last = ready if whole else None
        time.sleep(2)
    raise RuntimeError(f"the models did not all load on every worker: {readiness(url)}")


class Soak:
    def __init__(self, url: str, supervisor: int, redis_pid: int, args: argparse.Namespace):
        self.url, self.supervisor, self.redis_pid, self.args = url, supervisor, redis_pid, args
        self.samples: list[dict[str, Any]] = []
        self.p99: list[dict[str, float]] = []
        self.jobs: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def t(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def sample(self) -> None:
        roles = names(self.url, self.supervisor)
        processes: dict[str, dict[str, float]] = {}
        for pid in [*descendants(self.supervisor), self.redis_pid]:
            state = process_state(pid)
            if state is None:
                continue
            comm, rss, fds = state
            role = "redis" if pid == self.redis_pid else roles.get(pid, comm)
            if role in processes:  # HAProxy's master and worker, say: one line, summed
                processes[role]["rss_mib"] += rss
                processes[role]["fds"] += fds
            else:
                processes[role] = {"rss_mib": rss, "fds": fds}
        self.samples.append({"t": self.t(), "processes": processes})

    def submit_job(self) -> None:
        status, doc = post(f"{self.url}/v2/models/churn/jobs", churn_body(self.args.job_rows))
        if status == 202:
            self.jobs.append(doc["id"])
        self.events.append({"t": self.t(), "event": "job", "status": status})

    def reload(self, model: str) -> None:
        status, doc = post(f"{self.url}/v2/repository/models/{model}/load")
        self.events.append({"t": self.t(), "event": f"reload {model}", "status": status})
        if status != 200:
            print(f"  reload of {model}: {status} {doc}")

    def job_outcomes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job_id in self.jobs:
            deadline = time.monotonic() + 60
            while True:
                status = _harness.get_json(f"{self.url}/v2/jobs/{job_id}")["status"]
                if status not in ("queued", "running") or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            counts[status] = counts.get(status, 0) + 1
        return counts

    def run(self) -> None:
        seconds = self.args.minutes * 60
        before = _harness.histogram(self.url, "tailserve_request_duration_seconds")
        next_sample = next_minute = 0.0
        next_job, next_reload, reloads = 30.0, 60.0, 0
        shot_at = float(self.args.screenshot_at)
        while (now := time.monotonic() - self.started) < seconds:
            if now >= next_sample:
                self.sample()
                next_sample += self.args.sample_s
            if now >= next_minute and now > 0:
                after = _harness.histogram(self.url, "tailserve_request_duration_seconds")
                p99 = _harness.histogram_quantile(before, after, 0.99) * 1000
                self.p99.append({"t": self.t(), "server_p99_ms": p99})
                before = after
            if now >= next_minute:
                next_minute += 60
            if now >= next_job:
                self.submit_job()
                next_job += 60
            if now >= next_reload:
                self.reload(RELOADED[reloads % len(RELOADED)])
                reloads += 1
                next_reload += 120
            if shot_at and now >= shot_at:
                self.screenshot()
                shot_at = 0.0
            time.sleep(0.25)
        self.sample()

    def screenshot(self) -> None:
        script = Path(__file__).with_name("dashboard_screenshot.py")
        if not script.exists():
            print("  (no dashboard_screenshot.py: no screenshot)")
            return
        target = self.args.out / "dashboard.png"
        command = [sys.executable, str(script), self.url, "--out", str(target), "--samples", "3"]
        threading.Thread(target=subprocess.run, args=(command,), daemon=True).start()


def series(soak: Soak, role: str, field: str) -> tuple[list[float], list[float]]:
    points = [(s["t"], s["processes"][role][field]) for s in soak.samples if role in s["processes"]]
    return [p[0] for p in points], [p[1] for p in points]


def verdicts(soak: Soak, timeline: list[dict[str, Any]]) -> list[str]:
    """Memory growth after the first third (warm-up, caches filling), descriptors, p99 drift."""
    lines = [
        "| process | RSS at 1/3 (MiB) | RSS at the end | growth | fds at 1/3 | fds at the end |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    roles = sorted({r for s in soak.samples for r in s["processes"]})
    third = soak.args.minutes * 60 / 3
    for role in roles:
        t, rss = series(soak, role, "rss_mib")
        _, fds = series(soak, role, "fds")
        if not t:
            continue
        i = next((k for k, x in enumerate(t) if x >= third), 0)
        growth = rss[-1] - rss[i]
        lines.append(
            f"| {role} | {rss[i]:.0f} | {rss[-1]:.0f} | {growth:+.1f} MiB | {fds[i]:.0f} | "
            f"{fds[-1]:.0f} |"
        )
    p99s = [p["p99_ms"] for p in timeline if p.get("p99_ms") is not None]
    if len(p99s) >= 600:
        first, last = statistics.median(p99s[60:360]), statistics.median(p99s[-300:])
        lines.append("")
        lines.append(
            f"Median of the per-second p99 (tailserve bench, churn-zipf): minutes 1-6 "
            f"{first:.2f} ms, last 5 minutes {last:.2f} ms ({last / first:.2f}x)."
        )
    return lines


def plot(soak: Soak, timeline: list[dict[str, Any]], out: Path) -> None:
    plt = _harness.pyplot()
    if plt is None:
        return
    figure, (memory, fds, latency) = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    roles = sorted({r for s in soak.samples for r in s["processes"]})
    for role in roles:
        t, rss = series(soak, role, "rss_mib")
        memory.plot([x / 60 for x in t], rss, label=role)
        t, count = series(soak, role, "fds")
        fds.plot([x / 60 for x in t], count, label=role)
    memory.set(ylabel="resident MiB", title="memory per process")
    fds.set(ylabel="open descriptors", title="file descriptors per process")
    minutes = [p["t"] / 60 for p in timeline]
    latency.plot(minutes, [p.get("p99_ms") for p in timeline], lw=0.6, label="bench p99 (1 s)")
    latency.plot(
        [p["t"] / 60 for p in soak.p99],
        [p["server_p99_ms"] for p in soak.p99],
        "o-",
        label="stack p99 (1 min, /metrics)",
    )
    for event in soak.events:
        if event["event"].startswith("reload"):
            latency.axvline(event["t"] / 60, color="grey", lw=0.5, ls=":")
    latency.set(xlabel="minutes", ylabel="ms", title="p99 (dotted lines: model reloads)")
    for axes in (memory, fds, latency):
        axes.legend(fontsize=7, loc="upper left")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "soak.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=300, help="tailserve bench, churn-zipf")
    parser.add_argument("--wrk2-rate", type=float, default=1000, help="wrk2, unique churn rows")
    parser.add_argument("--job-rows", type=int, default=2000)
    parser.add_argument("--sample-s", type=float, default=5)
    parser.add_argument("--screenshot-at", type=float, default=0, help="seconds in; 0: none")
    parser.add_argument("--out", type=Path, default=Path("var/soak"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    repository = _harness.examples(work / "repository")
    with _harness.redis(work) as redis_url:
        _harness.examples(repository, "--features-only", "--redis-url", redis_url)
        info = _harness.redis_command(redis_url, "INFO", "server").decode()
        redis_pid = int(info.split("process_id:")[1].split()[0])
        port = _harness.free_port()
        command = _harness.up_command(repository, port, "--redis-url", redis_url)
        with _harness.server_process(command, port, start_new_session=True) as (url, process):
            _harness.wait_served(url, "churn", churn_body(1))
            wait_loaded(url)
            print(f"soak: {args.minutes:g} minutes on {url} (supervisor pid {process.pid})")
            wrk2: dict[str, _wrk2.Run] = {}
            load = threading.Thread(
                target=lambda: wrk2.update(run=_wrk2.run(url, args.wrk2_rate, seconds, 64)),
                daemon=True,
            )
            bench_out = args.out / "bench.json"
            bench = subprocess.Popen(
                [
                    sys.executable, "-m", "tailserve.cli", "bench",
                    str(_harness.WORKLOADS / "churn-zipf.yaml"), "--target", url,
                    "--rate", str(args.rate), "--duration", str(seconds), "--warmup", "0",
                    "--out", str(bench_out), "--quiet",
                ],
                **_harness.QUIET,
            )  # fmt: skip
            load.start()
            soak = Soak(url, process.pid, redis_pid, args)
            soak.run()
            bench.wait(timeout=120)
            load.join(timeout=120)
            jobs = soak.job_outcomes()
    result = orjson.loads(bench_out.read_bytes())
    timeline = result.get("timeline", [])
    (args.out / "samples.json").write_bytes(
        orjson.dumps(
            {"samples": soak.samples, "p99": soak.p99, "events": soak.events, "jobs": jobs},
            option=orjson.OPT_INDENT_2,
        )
    )
    plot(soak, timeline, args.out)
    lines = [f"# Soak: {args.minutes:g} minutes", "", *verdicts(soak, timeline), ""]
    overall = result["overall"]
    lines.append(
        f"tailserve bench (churn-zipf, {args.rate:g} req/s): p50 {overall['p50_ms']:.2f} ms, "
        f"p99 {overall['p99_ms']:.2f} ms, p99.9 {overall['p999_ms']:.2f} ms, "
        f"{overall['count']} requests, {overall['errors']} errors."
    )
    if "run" in wrk2:
        run = wrk2["run"]
        lines.append(
            f"wrk2 (unique churn rows, {args.wrk2_rate:g} req/s, 64 connections): "
            f"p50 {run.quantile(0.5):.2f} ms, p99 {run.quantile(0.99):.2f} ms, "
            f"p99.9 {run.quantile(0.999):.2f} ms; 200s {run.ok}, 503s {run.unavailable}, "
            f"429s {run.refused}, other {run.other}, socket errors {run.socket_errors} "
            f"(connect, read, write, timeout: {', '.join(map(str, run.socket_kinds))})."
        )
    reloads = [e for e in soak.events if e["event"].startswith("reload")]
    lines.append(
        f"Jobs: {jobs}. Reloads: {len(reloads)}, "
        f"{sum(e['status'] == 200 for e in reloads)} answered 200."
    )
    report = "\n".join(lines) + "\n"
    (args.out / "report.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
