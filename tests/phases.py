"""`make test`'s checks after ruff, in two lanes at once (docs/testing.md).

The foreground lane trains the examples (which both lanes' tests serve), then runs the tests
whose outcome rests on time (the `serial` marker, tests/conftest.py) one at a time, at the
machine's normal priority, its output shown as it comes. Those tests spend about half their
time waiting on time itself (a deadline, a sweep, a recovery), so a core is mostly free beside
them.

The background lane takes that free time at a lower priority (nice 5, its session too), so
that it takes little of a core a timing test wants: mypy, the import layers, then every other
test two at a time (pytest-xdist). Its output is kept and shown once the foreground is done.
The whole fails if either lane fails, naming the steps that did.

Usage: python tests/phases.py [BIN], BIN being the folder of the virtual environment's
programs (default: the running interpreter's). `--lane LOGS` after BIN runs the background
lane itself (what the foreground starts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tailserve.process.sessions import set_session_nice

ROOT = Path(__file__).resolve().parent.parent

# The test files whose outcome rests on time: deadlines and SLOs met or missed, capacity
# searches, recovery within bounds, refusals counted under load. They run one test at a time in
# the foreground lane: beside another test they could fail for want of a core, not for a bug.
# (tests/conftest.py marks their tests `serial`, for `pytest -m serial`.)
SERIAL = {
    # (not for time: schemathesis runs a route's generated cases only in the main process)
    "fuzz/test_openapi_fuzz.py",
    "integration/test_autoscale.py",
    "integration/test_bench.py",
    "integration/test_bench_grpc.py",
    "integration/test_chaos.py",
    "integration/test_dashboard.py",
    "integration/test_deadlines.py",
    "integration/test_front_door.py",
    "integration/test_front_door_grpc.py",
    "integration/test_http_client.py",
    # (Redis keeps the stores' holds by its own clock: a short hold really passes)
    "integration/test_job_stores.py",
    "integration/test_jobs_fleet.py",
    "integration/test_many_models.py",
    "integration/test_precompute.py",
    "integration/test_redis_cluster_up.py",
    "integration/test_router.py",
    "integration/test_router_grpc.py",
    "integration/test_security_http.py",
    "integration/test_stack_metrics.py",
    "integration/test_stale_if_overloaded.py",
    "unit/test_loop_lag.py",
    "unit/test_timer.py",
}
# The background lane's nice value (`_lower_priority`).
LANE_NICE = 5
# Where tests/conftest.py's `examples_command` keeps the trained examples (pytest's cache).
EXAMPLES_CACHE = ".pytest_cache/d/examples"


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]


def steps(bin_dir: Path) -> tuple[list[Step], list[Step]]:
    """The background lane's steps and the foreground's, each in order."""
    # Each lane collects only its own files: collecting them all imports torch, scikit-learn and
    # LightGBM, about 15 s of a core on a 2 GHz machine.
    timed = [f"tests/{name}" for name in sorted(SERIAL)]
    python = str(bin_dir / "python")
    pytest = [python, "-m", "pytest", "-q", "--durations=10"]
    foreground = [
        # (first, at full priority: both lanes' tests serve them; 15-20 s of a core)
        Step("the examples, trained", [python, "tests/support/examples.py", EXAMPLES_CACHE]),
        Step("tests that rest on time, one at a time", [*pytest, *timed]),
    ]
    background = [
        Step("mypy", [str(bin_dir / "mypy")]),
        Step("import layers", [str(bin_dir / "lint-imports")]),
        Step(
            "the other tests, two at a time",
            [*pytest, "-n", "2", "--dist", "loadfile", "-m", "not serial"]
            + [f"--ignore={path}" for path in timed],
        ),
    ]
    return background, foreground


def _lower_priority() -> None:
    """In the background lane's first process, in a session of its own: what it and every
    process it starts run at. Nice 5 gives the foreground three quarters of the CPU when both
    lanes want it (weights 1024 and 335). Not the least weight there is: the lane's tests have
    bounds of their own (a store's 250 ms, a model's SLO), and a lane at SCHED_IDLE, which got
    no core for seconds beside a saturating timing test, broke them. With Linux's autogroups
    the CPU is shared between sessions first, so the lane's session is given the same nice
    value, and the stacks it starts keep it in sessions of their own (process/sessions.py)."""
    os.nice(LANE_NICE)
    set_session_nice(LANE_NICE)


def run_lane(background: list[Step], logs: Path) -> None:
    """The background lane: each step in turn, into its own log, its exit status beside it."""
    for number, step in enumerate(background):
        began = time.monotonic()
        with (logs / f"{number}.log").open("w") as out:
            code = subprocess.call(step.argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        (logs / f"{number}.rc").write_text(f"{code} {time.monotonic() - began:.0f}")


def main(argv: list[str]) -> int:
    bin_dir = Path(argv[1]) if len(argv) > 1 else Path(sys.executable).parent
    background, foreground = steps(bin_dir.resolve())
    if len(argv) > 3 and argv[2] == "--lane":
        run_lane(background, Path(argv[3]))
        return 0
    with tempfile.TemporaryDirectory(prefix="tailserve-phases-") as folder:
        logs = Path(folder)
        started = time.monotonic()
        lane = subprocess.Popen(
            [sys.executable, __file__, str(bin_dir), "--lane", str(logs)],
            cwd=ROOT,
            preexec_fn=_lower_priority,
            start_new_session=True,  # one process group: stopped as one, should this stop early
        )
        try:
            failed = []
            for step in foreground:
                print(f"== {step.name} (the other checks run meanwhile)", flush=True)
                if subprocess.call(step.argv, cwd=ROOT):
                    failed.append(step.name)
            lane.wait()
        finally:
            if lane.poll() is None:
                os.killpg(lane.pid, signal.SIGKILL)
        for number, step in enumerate(background):
            log, rc = logs / f"{number}.log", logs / f"{number}.rc"
            code, took = rc.read_text().split() if rc.exists() else ("-", "-")
            print(f"\n== {step.name} ({took} s)", flush=True)
            sys.stdout.write(log.read_text() if log.exists() else "(not run)\n")
            if code != "0":
                failed.append(step.name)
        took = time.monotonic() - started
        print(f"\n== {len(background) + len(foreground)} steps in {took:.0f} s", end="")
        print(f"; failed: {', '.join(failed)}" if failed else "; all passed", flush=True)
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
