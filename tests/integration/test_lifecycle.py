"""Warm-up gates readiness, SIGTERM drains without losing a request, reloads fail nothing."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import re
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

from support.models import add_version, doubler_config, write_model
from support.servers import run_worker, wait_for, worker_process
from tailserve.settings import Settings

# Blocks in predict until a gate file exists, and marks each call: warm-up runs predict, so the
# model cannot be ready before the gate opens.
GATED = """
import os
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.gate = Path(config.parameters["gate"])
        self.marks = Path(config.parameters["marks"])
        self.delay = float(config.parameters.get("delay", 0.0))

    def predict(self, inputs):
        while not self.gate.exists():
            time.sleep(0.01)
        with self.marks.open("a") as marks:
            marks.write(f"predict {len(inputs['x'])}\\n")
        time.sleep(self.delay)
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""


def body(value: float) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [value]}]}


def test_not_ready_until_warm_up_has_run(tmp_path: Path) -> None:
    gate, marks = tmp_path / "gate", tmp_path / "marks"
    repo = tmp_path / "repo"
    params = {"gate": str(gate), "marks": str(marks)}
    write_model(repo, "gated", doubler_config(parameters=params), code=GATED)
    with run_worker(Settings(repository=str(repo)), wait_ready=False) as running:
        assert httpx.get(f"{running.url}/v2/health/ready").status_code == 503
        assert httpx.get(f"{running.url}/v2/models/gated/ready").status_code == 400
        reply = httpx.post(f"{running.url}/v2/models/gated/infer", json=body(1.0))
        assert reply.status_code == 503
        assert not marks.exists()
        gate.touch()
        wait_for(
            lambda: httpx.get(f"{running.url}/v2/health/ready").status_code == 200,
            what="readiness after warm-up",
        )
        # Warm-up ran every configured batch size before readiness was reported (each until
        # its time settled, to seed its cost class: more than once).
        sizes = [int(line.split()[1]) for line in marks.read_text().splitlines()]
        assert set(sizes) == set(doubler_config()["warmup"]["batch_sizes"])
        assert all(sizes.count(size) >= 2 for size in set(sizes))
        stats = httpx.get(f"{running.url}/v2/models/gated/stats").json()["model_stats"][0]
        classes = stats["batching"]["cost_model"]
        assert classes and all(m["observations"] > 0 for m in classes.values()), classes
        assert httpx.post(f"{running.url}/v2/models/gated/infer", json=body(1.0)).status_code == 200


def test_sigterm_finishes_every_request_in_flight_and_exits_zero(tmp_path: Path) -> None:
    gate, marks = tmp_path / "gate", tmp_path / "marks"
    gate.touch()
    repo = tmp_path / "repo"
    config = doubler_config(
        parameters={"gate": str(gate), "marks": str(marks), "delay": 0.4},
        batching={"max_queue_delay_ms": 0, "max_queue_size": 64},
        max_batch_size=2,
        warmup={"batch_sizes": [1], "repeat": 0},
    )
    write_model(repo, "slow", config, code=GATED)
    trace = tmp_path / "received.jsonl"
    options = ("--drain-timeout", "20", "--trace-file", str(trace))
    with worker_process(repo, tmp_path, *options) as proc:

        def call(i: int) -> httpx.Response:
            return httpx.post(f"{proc.url}/v2/models/slow/infer", json=body(float(i)), timeout=30)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, i) for i in range(8)]
            # Every request has arrived (the worker logs each one it receives) and the first
            # batch is running, the rest queued behind it, before the signal.
            wait_for(
                lambda: trace.exists() and trace.read_text().count("\n") == 8,
                what="all 8 requests to arrive",
            )
            wait_for(lambda: marks.exists(), what="the first batch to start")
            code = proc.terminate(timeout=30)
            replies = [f.result() for f in futures]
        assert code == 0, proc.log()
        assert [r.status_code for r in replies] == [200] * 8
        assert [r.json()["outputs"][0]["data"] for r in replies] == [[2.0 * i] for i in range(8)]
        assert "draining" in proc.log()
        # The socket is closed: nothing new is accepted.
        try:
            refused = httpx.get(f"{proc.url}/v2/health/live", timeout=2).status_code != 200
        except httpx.HTTPError:
            refused = True
        assert refused


def held_model(tmp_path: Path) -> tuple[Path, Path]:
    """A repository whose model ``held`` waits in predict while the gate file is missing (it
    is there for warm-up), and the gate."""
    gate = tmp_path / "gate"
    gate.touch()
    config = doubler_config(
        parameters={"gate": str(gate), "marks": str(tmp_path / "marks")},
        batching={"max_queue_delay_ms": 0, "max_queue_size": 64},
        max_batch_size=1,
        warmup={"batch_sizes": [1], "repeat": 0},
        slo={"p99_ms": 60000},  # held requests wait for seconds: no deadline may refuse them
    )
    write_model(tmp_path / "repo", "held", config, code=GATED)
    return tmp_path / "repo", gate


def test_sigterm_twice_is_one_request_to_stop(tmp_path: Path) -> None:
    """As a parent passing SIGTERM on delivers it: the second is the same request, and the
    drain still answers every request in flight."""
    repo, gate = held_model(tmp_path)
    trace = tmp_path / "received.jsonl"
    options = ("--drain-timeout", "30", "--trace-file", str(trace))
    with worker_process(repo, tmp_path, *options) as proc:
        gate.unlink()

        def call(i: int) -> httpx.Response:
            return httpx.post(f"{proc.url}/v2/models/held/infer", json=body(float(i)), timeout=60)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(call, i) for i in range(4)]
            wait_for(
                lambda: trace.exists() and trace.read_text().count("\n") == 4,
                what="all 4 requests to arrive",
            )
            proc.process.send_signal(signal.SIGTERM)
            # Two signals sent before the first is delivered would arrive as one.
            wait_for(lambda: "draining" in proc.log(), what="the first signal taken")
            proc.process.send_signal(signal.SIGTERM)
            wait_for(
                lambda: "the same request to stop" in proc.log() or "forcing" in proc.log(),
                what="the second signal taken",
            )
            gate.touch()
            replies = [f.result() for f in futures]
            code = proc.process.wait(timeout=30)
        assert code == 0, proc.log()
        assert [r.status_code for r in replies] == [200] * 4, proc.log()
        assert [r.json()["outputs"][0]["data"] for r in replies] == [[2.0 * i] for i in range(4)]
        assert "forcing the stop" not in proc.log()


def test_sigquit_cuts_the_drain_short(tmp_path: Path) -> None:
    repo, gate = held_model(tmp_path)
    trace = tmp_path / "received.jsonl"
    options = ("--drain-timeout", "30", "--trace-file", str(trace))
    with worker_process(repo, tmp_path, *options) as proc:
        gate.unlink()
        url = f"{proc.url}/v2/models/held/infer"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(httpx.post, url, json=body(1.0), timeout=60)
            wait_for(lambda: trace.exists() and trace.read_text() != "", what="the request")
            proc.process.send_signal(signal.SIGQUIT)
            # Its connection closes at once, while its model still holds it (a drain would
            # wait for it up to 30 s).
            with pytest.raises(httpx.HTTPError):
                future.result(timeout=15)
        # The process exits once its model lets go of the request.
        gate.touch()
        assert proc.process.wait(timeout=30) == 0, proc.log()
        assert "SIGQUIT: forcing the stop" in proc.log()


def test_reload_to_a_new_version_under_load_fails_no_request(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    folder = write_model(repo, "doubler", doubler_config())
    with run_worker(Settings(repository=str(repo))) as running:
        stop = threading.Event()
        statuses: list[int] = []
        versions: list[str] = []

        def hammer() -> None:
            with httpx.Client() as client:
                while not stop.is_set():
                    reply = client.post(f"{running.url}/v2/models/doubler/infer", json=body(1.0))
                    statuses.append(reply.status_code)
                    if reply.status_code == 200:
                        versions.append(reply.json()["model_version"])

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: len(statuses) > 50, what="traffic on version 1")
            add_version(folder, 2)
            load = httpx.post(f"{running.url}/v2/repository/models/doubler/load", timeout=60)
            assert load.status_code == 200, load.text
            seen = len(statuses)
            wait_for(lambda: len(statuses) > seen + 50, what="traffic after the swap")
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert set(statuses) == {200}
        assert versions[0] == "1" and versions[-1] == "2"
        assert httpx.get(f"{running.url}/v2/models/doubler").json()["versions"] == ["2"]


@pytest.mark.parametrize(("setting_ms", "expected_s"), [(1.5, 0.0015), (0.0, 0.004)])
def test_the_worker_sets_the_gil_switch_interval_unless_told_not_to(
    tmp_path: Path, setting_ms: float, expected_s: float
) -> None:
    # A model's thread waits for the GIL at most about this long while the event loop is busy.
    write_model(tmp_path, "m", doubler_config())
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)  # what "0: keep the interpreter's own" must leave alone
    try:
        with run_worker(Settings(repository=str(tmp_path), gil_switch_interval_ms=setting_ms)):
            assert sys.getswitchinterval() == pytest.approx(expected_s)
    finally:
        sys.setswitchinterval(before)


def test_the_worker_runs_full_collections_on_its_schedule_and_reports_them(
    tmp_path: Path,
) -> None:
    # The interpreter starts none while the worker serves; the worker's loop runs them.
    write_model(tmp_path, "m", doubler_config())
    before = gc.get_threshold()
    with run_worker(Settings(repository=str(tmp_path), gc_full_interval_s=0.05)) as running:
        assert gc.get_threshold()[2] > 10**6

        def collections() -> float:
            text = httpx.get(f"{running.url}/metrics").text
            found = re.search(r"^tailserve_gc_full_pause_seconds_count (\S+)$", text, re.M)
            return float(found.group(1)) if found else 0.0

        wait_for(lambda: collections() >= 1, what="a scheduled full collection in the metrics")
    assert gc.get_threshold() == before


def features_config() -> dict[str, object]:
    """The doubler, its input filled from the feature store by a user id."""
    user = {"input": "x", "key": "user_id", "entity": "user", "fields": ["f0"]}
    return doubler_config(features={"inputs": [user]})


@pytest.mark.parametrize("strict", [False, True])
def test_a_model_that_needs_redis_is_left_out_without_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, strict: bool
) -> None:
    # No --redis-url: the worker cannot serve a model that reads the feature store. That is
    # said once at INFO and reported; it is no failure, so even strict readiness is met.
    write_model(tmp_path, "plain", doubler_config())
    write_model(tmp_path, "ranked", features_config())
    caplog.set_level("INFO")
    with run_worker(Settings(repository=str(tmp_path), strict_readiness=strict)) as running:
        assert httpx.get(f"{running.url}/v2/health/ready").status_code == 200
        assert httpx.post(f"{running.url}/v2/models/plain/infer", json=body(1.0)).status_code == 200
        assert httpx.get(f"{running.url}/v2/models/ranked/ready").status_code == 400
        index = httpx.post(f"{running.url}/v2/repository/index").json()
        ranked = next(entry for entry in index if entry["name"] == "ranked")
        assert ranked["state"] == "UNAVAILABLE" and "--redis-url" in ranked["reason"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    said = [r for r in caplog.records if "'ranked'" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"]
    assert "not served" in said[0].getMessage() and "--redis-url" in said[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records)


def test_strict_readiness_still_counts_a_model_that_failed(tmp_path: Path) -> None:
    write_model(tmp_path, "ranked", features_config())
    write_model(tmp_path, "broken", doubler_config(parameters={"fail_load": True}))
    with run_worker(Settings(repository=str(tmp_path), strict_readiness=True)) as running:
        assert httpx.get(f"{running.url}/v2/health/ready").status_code == 503
