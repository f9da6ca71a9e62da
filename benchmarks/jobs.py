"""Jobs beside online traffic: 10,000 jobs submitted at once while online requests run at half
the stack's SLO capacity, against the same online load with no jobs, side by side.

The stack is `tailserve up --workers 2 --redis-url URL` on the example repository (jobs in
Redis Streams). Online load: wrk2 (open loop, C), unique churn rows, 64 connections (or
`--connections`), for the same measured window in each run. The jobs are submitted by
h2load (C, 64 connections; those refused are sent again a second later), their drain is
watched in Redis (the stream's length) and they are checked there after the window, so no
Python client shares the cores with the stack while the load is measured. Runs:

- `off`: online load only;
- `jobs`: online load, and 10,000 churn jobs of ``--rows`` rows each submitted at once
  through the front door a few seconds into the window;
- `kill`: the same, and one worker SIGKILLed 10 s after the submissions began, while jobs
  are queued and it holds some (the supervisor starts it again; the jobs it held go to a
  worker after the visibility timeout, 5 s here);
- `kill, no jobs`: online load only, and a worker SIGKILLed at the same moment: what losing
  a worker costs the online requests by itself.

For each run it prints the online p50/p99/p99.9 and errors, and for the job runs the time to
submit, the time until every job had finished, the jobs drained a second, and the check that
every job succeeded with one result of the right rows (and, after the kill, how many jobs ran
more than once).

    python benchmarks/jobs.py [--capacity RPS] [--jobs 10000] [--rows 20] [--connections 64]
                              [--seconds 60] [--out DIR]

Without `--capacity`, the stack's SLO capacity is searched first (about 3 min). Needs wrk2
on the PATH (see benchmarks/_wrk2.py), h2load (Debian's nghttp2-client) and redis-server.
Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import orjson

import _wrk2
from _harness import examples, get_json, redis, redis_command, up_stack
from tailserve.examples.churn import FIELDS, sample_rows

SLO_MS = 50.0
SUBMIT_AT_S = 3.0  # into the measured window
VISIBILITY_S = 5.0
KILL_AFTER_S = 10.0  # after the submissions began
JOBS_PREFIX = "tailserve:jobs"  # the job store's keys (jobs/redis_store.py)
_STATUS = re.compile(r"status codes: (\d+) 2xx")
_RUNNING = re.compile(r'tailserve_jobs_running\{worker="([^"]+)"\} [1-9]')


@dataclass
class Outcome:
    name: str
    online: _wrk2.Run | None = None
    submitted_s: float = 0.0
    drained_s: float | None = None
    jobs: int = 0
    succeeded: int = 0
    wrong: list[str] = field(default_factory=list)
    retried: int = 0
    killed: str | None = None
    refusals: int = 0  # submissions refused (and sent again)


def stack(repository: Path, redis_url: str) -> contextlib.AbstractContextManager[str]:
    return up_stack(
        repository,
        "--workers",
        "2",
        "--redis-url",
        redis_url,
        "--jobs-visibility-timeout",
        str(VISIBILITY_S),
    )


def job_body(rows: int, seed: int) -> bytes:
    sample = sample_rows(rows, seed)
    inputs = [
        {"name": f.name, "datatype": f.datatype, "shape": [rows, 1], "data": list(sample[f.name])}
        for f in FIELDS
    ]
    return orjson.dumps({"inputs": inputs}, option=orjson.OPT_SERIALIZE_NUMPY)


def submit(url: str, body: Path, jobs: int) -> int:
    """``jobs`` submissions at once from h2load (C, 64 connections), then those refused (429
    while the workers' online requests come first, 503 from a busy front door, a connection
    lost with a killed worker) again after a second, until every one is in; the refusals."""
    remaining, refusals = jobs, 0
    while remaining:
        command = [
            "h2load",
            "--h1",
            "-n",
            str(remaining),
            "-c",
            str(min(64, remaining)),
            "-d",
            str(body),
            "-H",
            "content-type: application/json",
            f"{url}/v2/models/churn/jobs",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        found = _STATUS.search(done.stdout)
        if found is None:
            raise RuntimeError(f"h2load said: {done.stdout[-500:]} {done.stderr[-500:]}")
        accepted = int(found.group(1))
        refusals += remaining - accepted
        remaining -= accepted
        if remaining:
            time.sleep(1.0)  # the Retry-After
    return refusals


def queued(redis_url: str) -> int:
    """Jobs of churn waiting or running: the length of its stream."""
    reply = redis_command(redis_url, "XLEN", f"{{{JOBS_PREFIX}}}:q:churn")
    return int(reply.strip().lstrip(b":") or b"0")


def check_jobs(redis_url: str, rows: int, outcome: Outcome) -> None:
    """Every job of the run as the store holds it: succeeded with one result of ``rows``
    rows; how many ran more than once. Then they are deleted, for the next run."""
    import redis as redis_py

    client = redis_py.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{{{JOBS_PREFIX}}}:job:*", count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "status", "attempts", "result")
        for key, (status, attempts, result) in zip(keys, pipe.execute(), strict=True):
            outputs = orjson.loads(result)["outputs"] if result else []
            if status == b"succeeded" and outputs and outputs[0]["shape"][0] == rows:
                outcome.succeeded += 1
            else:
                outcome.wrong.append(f"{key!r}: {status!r}")
            outcome.retried += int(attempts or 0) > 1
        outcome.jobs = len(keys)
        for key in [*keys, f"{{{JOBS_PREFIX}}}:index"]:
            client.unlink(key)
    finally:
        client.close()


def kill_a_worker(url: str, outcome: Outcome, look_s: float = 60.0) -> None:
    """SIGKILL a worker while it holds jobs (`tailserve_jobs_running` in the stack's merged
    metrics), or, after ``look_s`` of looking, the first that serves."""
    deadline = time.monotonic() + look_s
    holding = None
    while holding is None and time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            page = reply.read().decode()
        found = _RUNNING.search(page)
        holding = found.group(1) if found else None
        time.sleep(0.05)
    for worker in get_json(f"{url}/v2/fleet")["workers"]:
        if worker["pid"] and (worker["name"] == holding or holding is None):
            os.kill(int(worker["pid"]), signal.SIGKILL)
            outcome.killed = worker["name"] + ("" if holding else " (holding none seen)")
            return


def run_jobs(
    url: str, redis_url: str, outcome: Outcome, jobs: int, rows: int, kill: bool, start_s: float
) -> None:
    """In the background of the online load: submit, (kill), wait until all have finished,
    then check them in Redis (after the window: the check loads nothing the load measures)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as body:
        body.write(job_body(rows, seed=7))
        body.flush()
        time.sleep(start_s)
        started = time.monotonic()
        killer = threading.Timer(KILL_AFTER_S, kill_a_worker, (url, outcome)) if kill else None
        if killer is not None:
            killer.start()
        outcome.refusals = submit(url, Path(body.name), jobs)
        outcome.submitted_s = time.monotonic() - started
        while queued(redis_url):
            time.sleep(0.2)
        outcome.drained_s = time.monotonic() - started
        if killer is not None:
            killer.join()


def one_run(
    name: str,
    urls: tuple[str, str],
    rate: float,
    seconds: float,
    jobs: int,
    rows: int,
    kill: bool,
    connections: int,
) -> Outcome:
    url, redis_url = urls
    outcome = Outcome(name)
    worker = None
    start_s = _wrk2.calibration_s(connections) + SUBMIT_AT_S  # into the measured window
    if jobs:
        worker = threading.Thread(
            target=run_jobs, args=(url, redis_url, outcome, jobs, rows, kill, start_s)
        )
        worker.start()
    elif kill:  # the same moment as with jobs, and no jobs to wait for
        worker = threading.Timer(start_s + KILL_AFTER_S, kill_a_worker, (url, outcome, 0.0))
        worker.start()
    outcome.online = _wrk2.run(url, rate, seconds, connections=connections)
    if worker is not None:
        worker.join()
    if jobs:
        check_jobs(redis_url, rows, outcome)
    return outcome


def report(outcomes: list[Outcome], rate: float, jobs: int, rows: int, connections: int) -> str:
    lines = [
        f"online load: {rate:.0f} req/s of churn (half the SLO capacity), wrk2, "
        f"{connections} connections;"
        f" jobs: {jobs:,} of {rows} rows each, submitted at once",
        "",
        "| run | online p50 ms | p99 ms | p99.9 ms | online errors | submit s | refused |"
        " all done s | jobs/s | succeeded | ran twice |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for o in outcomes:
        run = o.online
        assert run is not None
        rate_done = f"{o.jobs / o.drained_s:,.0f}" if o.drained_s else "-"
        lines.append(
            f"| {o.name} | {run.quantile(0.5):.2f} | {run.quantile(0.99):.2f} | "
            f"{run.quantile(0.999):.2f} | {run.errors} | "
            f"{o.submitted_s:.1f} | {o.refusals:,} | {o.drained_s or 0:.1f} | {rate_done} | "
            f"{o.succeeded:,}/{o.jobs:,} | {o.retried} |"
        )
    lines.append("")
    offs = [
        o.online.quantile(0.99)
        for o in outcomes
        if not o.jobs and not o.killed and o.online is not None
    ]
    for o in outcomes:
        if o.jobs and o.online is not None and offs:
            p99 = o.online.quantile(0.99)
            within = "within" if p99 <= SLO_MS else "OVER"
            lines.append(
                f"{o.name}: online p99 {p99:.1f} ms, {within} the {SLO_MS:.0f} ms SLO; "
                f"{p99 / min(offs):.2f}x the better `off` run's, {p99 / max(offs):.2f}x the worse"
            )
    for o in outcomes:
        if o.killed:
            lines.append(
                f"{o.name}: SIGKILLed {o.killed} {KILL_AFTER_S:.0f} s after the submissions "
                f"began (or would have); {o.retried} jobs ran more than once"
            )
        if o.wrong:
            lines.append(f"{o.name}: {len(o.wrong)} jobs wrong, e.g. {o.wrong[0]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=float, help="the stack's SLO capacity, req/s")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=20, help="churn rows a job (20)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window (60)")
    parser.add_argument("--connections", type=int, default=64, help="wrk2's connections (64)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/jobs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        repository = examples(Path(tmp) / "repo")
        outcomes = []
        with redis(Path(tmp)) as redis_url, stack(repository, redis_url) as url:
            full = args.capacity or _wrk2.slo_capacity(url, 10.0, SLO_MS)
            rate = full / 2
            print(f"SLO capacity {full:.0f} req/s: online load {rate:.0f} req/s")
            # A fresh stack's first seconds: unmeasured.
            _wrk2.run(url, rate, 20.0, connections=args.connections)
            # `off` twice, first and last: the machine's noise between runs, side by side.
            runs = [
                ("off", 0, False),
                ("jobs", args.jobs, False),
                ("kill", args.jobs, True),
                ("kill, no jobs", 0, True),
                ("off again", 0, False),
            ]
            for name, jobs, kill in runs:
                print(f"run {name} ...", flush=True)
                outcome = one_run(
                    name,
                    (url, redis_url),
                    rate,
                    args.seconds,
                    jobs,
                    args.rows,
                    kill,
                    args.connections,
                )
                outcomes.append(outcome)
        text = report(outcomes, rate, args.jobs, args.rows, args.connections)
    print(text)
    (args.out / "jobs.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
