"""Every stop of `tailserve up` drains, however many times the signal arrives: SIGTERM twice (as
`make run` or a shell passing it on delivers it) answers every request in flight and exits 0;
SIGQUIT forces. Requests are held in flight by a model that waits for a gate file."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from support.models import doubler_config, write_model
from support.servers import wait_for
from support.up import UpProcess, alive, tailserve_up

# Waits in predict until the gate file exists (warm-up runs with it open).
HELD = """
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.gate = Path(config.parameters["gate"])

    def predict(self, inputs):
        while not self.gate.exists():
            time.sleep(0.01)
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""
IN_FLIGHT = "tailserve_requests_in_flight "
SLOT = re.compile(r"(\S+) started \(pid (\d+)\) on")
HELD_REQUESTS = 6


@dataclass
class Held:
    repository: Path
    gate: Path


@pytest.fixture
def held(tmp_path: Path) -> Held:
    gate = tmp_path / "gate"
    gate.touch()
    config = doubler_config(
        parameters={"gate": str(gate)},
        batching={"max_queue_delay_ms": 0, "max_queue_size": 64},
        max_batch_size=1,
        warmup={"batch_sizes": [1], "repeat": 0},
        # Held requests wait for seconds: no deadline may refuse them.
        slo={"p99_ms": 60000},
    )
    write_model(tmp_path / "repo", "held", config, code=HELD)
    return Held(tmp_path / "repo", gate)


def in_flight(up: UpProcess) -> int:
    """The requests the workers hold now (each one's gauge counts the scrape that reads it)."""
    total = 0
    for url in up.worker_urls():
        text = httpx.get(f"{url}/metrics", timeout=5).text
        (line,) = [line for line in text.splitlines() if line.startswith(IN_FLIGHT)]
        total += int(float(line[len(IN_FLIGHT) :])) - 1
    return total


def infer(url: str, value: int) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}
    return httpx.post(f"{url}/v2/models/held/infer", json=body, timeout=60)


@contextlib.contextmanager
def holding(up: UpProcess, held: Held) -> Iterator[list[Future[httpx.Response]]]:
    """Requests through the front door, every one of them held in a worker; the gate opens on
    the way out at the latest."""
    held.gate.unlink()
    pool = ThreadPoolExecutor(HELD_REQUESTS)
    try:
        futures = [pool.submit(infer, up.url, i) for i in range(HELD_REQUESTS)]
        wait_for(
            lambda: in_flight(up) == HELD_REQUESTS,
            what=f"{HELD_REQUESTS} requests in flight in the workers",
        )
        yield futures
    finally:
        held.gate.touch()
        pool.shutdown(wait=True)


def outcome(future: Future[httpx.Response]) -> int | str:
    """A reply's status, or the error that came instead."""
    try:
        return future.result(timeout=60).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def slots(up: UpProcess) -> dict[str, int]:
    """Every process the supervisor keeps (the workers and the hedging lane), by name."""
    return {name: int(pid) for name, pid in SLOT.findall(up.log())}


def assert_drained(up: UpProcess, code: int, replies: list[httpx.Response]) -> None:
    """Every request in flight answered, every process exited 0, nothing forced."""
    log = up.log()
    assert code == 0, log
    assert [reply.status_code for reply in replies] == [200] * HELD_REQUESTS, log
    assert [r.json()["outputs"][0]["data"] for r in replies] == [
        [2.0 * i] for i in range(HELD_REQUESTS)
    ]
    processes = slots(up)
    assert {"worker-0", "worker-1"} <= set(processes), log
    for name, pid in processes.items():
        assert f"{name} (pid {pid}) exited with 0" in log, log
    assert not [pid for pid in [*processes.values(), *up.front_door_pids()] if alive(pid)]
    assert "forcing the stop" not in log and "killed" not in log, log


def test_sigterm_twice_is_one_request_to_stop(held: Held, tmp_path: Path) -> None:
    with tailserve_up(held.repository, tmp_path, "--workers", "2") as up:
        with holding(up, held) as futures:
            up.process.send_signal(signal.SIGTERM)
            # Two signals sent before the first is delivered would arrive as one: the second
            # goes once the supervisor has taken the first.
            wait_for(lambda: "signalled: draining" in up.log(), what="the first signal taken")
            up.process.send_signal(signal.SIGTERM)
            wait_for(
                lambda: "the same request to stop" in up.log() or "forcing" in up.log(),
                what="the second signal taken",
            )
            held.gate.touch()
            replies = [future.result() for future in futures]
        assert_drained(up, up.process.wait(timeout=60), replies)


def test_sigterm_to_a_forwarding_wrapper_and_its_group_drains(held: Held, tmp_path: Path) -> None:
    forwarded = tmp_path / "forwarded"
    # As an entrypoint script runs a server: the signal to its group reaches `tailserve up`
    # directly, then again from the wrapper.
    wrapper = (
        '"$@" & child=$!; '
        f'trap "kill -TERM $child; touch {shlex.quote(str(forwarded))}" TERM INT; '
        "wait $child; wait $child"
    )
    with tailserve_up(
        held.repository, tmp_path, "--workers", "2", session=True, shell=wrapper
    ) as up:
        with holding(up, held) as futures:
            os.killpg(up.process.pid, signal.SIGTERM)
            wait_for(
                lambda: forwarded.exists() and "signalled: draining" in up.log(),
                what="the signal, directly and forwarded",
            )
            held.gate.touch()
            replies = [future.result() for future in futures]
        assert_drained(up, up.process.wait(timeout=60), replies)


def test_sigquit_kills_the_workers_at_once(held: Held, tmp_path: Path) -> None:
    with tailserve_up(held.repository, tmp_path, "--workers", "2", "--drain-timeout", "30") as up:
        with holding(up, held) as futures:
            processes = slots(up)
            begun = time.monotonic()
            up.process.send_signal(signal.SIGQUIT)
            up.process.wait(timeout=30)
            took = time.monotonic() - begun
            outcomes = [outcome(future) for future in futures]
        log = up.log()
        # Well within the 30 s a drain would wait for the held requests.
        assert took < 15, log
        assert 200 not in outcomes, outcomes
        assert "SIGQUIT: forcing the stop, killing the workers" in log
        for name, pid in processes.items():
            assert f"{name} (pid {pid}) exited with -9" in log, log
        assert not [pid for pid in [*processes.values(), *up.front_door_pids()] if alive(pid)]


LATE_REPEAT = """
import asyncio
import os
import signal

from tailserve.process.loops import StopSignals, run


async def main() -> None:
    stopped = asyncio.Event()
    signals = StopSignals(lambda stop: stopped.set())
    signals.install(asyncio.get_running_loop())
    os.kill(os.getpid(), signal.SIGTERM)
    await stopped.wait()
    signals.remove()  # the drain is over
    os.kill(os.getpid(), signal.SIGTERM)  # the same signal, passed on late


run(main())
"""


def test_a_repeat_after_the_drain_leaves_the_exit_status_0() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LATE_REPEAT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
