"""Many models on a worker under a memory budget (`--model-memory-mb`), a real worker process
on loopback: only what fits loads; a request for a cold model loads it (the least recently used
unloading) and waits when its deadline allows, or gets a 503 that says why; requests for one
cold model share its load; loads and unloads are in the metrics."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.ballast import X, ballasted_repository, infer
from support.servers import WorkerProcess, wait_for, worker_process

NAMES = [f"m{i}" for i in range(6)]
# Models of 16 MiB each; the budget holds five (80 MiB) and half of a sixth.
BUDGET_MB = "88"


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the worker's /metrics (0 when absent)."""
    page = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def index(url: str) -> dict[str, dict[str, str]]:
    entries = httpx.post(f"{url}/v2/repository/index", json={}).json()
    return {entry["name"]: entry for entry in entries}


@pytest.fixture
def budgeted(tmp_path: Path) -> Iterator[WorkerProcess]:
    repository = ballasted_repository(tmp_path / "repo", NAMES, load_s=0.3)
    with worker_process(repository, tmp_path, "--model-memory-mb", BUDGET_MB) as worker:
        yield worker


def test_five_fit_and_the_least_recently_used_unloads_for_a_sixth(
    budgeted: WorkerProcess,
) -> None:
    url = budgeted.url
    states = index(url)
    assert [states[n]["state"] for n in NAMES] == ["READY"] * 5 + ["UNAVAILABLE"]
    assert "memory budget" in states["m5"]["reason"]
    assert httpx.get(f"{url}/v2/models/m5/ready").status_code == 400
    assert metric(url, "tailserve_models_loaded") == 5
    budget = metric(url, "tailserve_model_memory_budget_bytes")
    held = sum(metric(url, "tailserve_model_memory_bytes", model=n) for n in NAMES)
    assert 5 * 16 * 2**20 <= held <= budget == 88 * 2**20
    assert httpx.post(f"{url}{infer('m0')}", json=X).status_code == 200  # m1: least recent

    reply = httpx.post(f"{url}{infer('m5')}", json=X, headers={"X-Deadline-Ms": "10000"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["outputs"][0]["data"] == [4.0]
    states = index(url)
    assert states["m5"]["state"] == "READY"
    assert states["m1"]["state"] == "UNAVAILABLE"
    assert "unloaded to fit" in states["m1"]["reason"]
    assert [n for n in NAMES if states[n]["state"] == "READY"] == ["m0", "m2", "m3", "m4", "m5"]
    # The worker stays ready: models unloaded for the budget are no failure.
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    assert metric(url, "tailserve_models_loaded") == 5
    assert metric(url, "tailserve_model_unload_seconds_count", model="m1", reason="budget") == 1
    assert metric(url, "tailserve_model_load_seconds_count", model="m5") == 1
    assert metric(url, "tailserve_model_load_seconds_sum", model="m5") >= 0.3
    assert metric(url, "tailserve_cold_requests_total", model="m5", outcome="waited") == 1


def test_a_cold_request_waits_if_its_deadline_allows_else_gets_a_clear_503(
    budgeted: WorkerProcess,
) -> None:
    url = budgeted.url
    # Each load takes over 0.3 s: 50 ms is too short. The load it asked for goes on.
    reply = httpx.post(f"{url}{infer('m5')}", json=X, headers={"X-Deadline-Ms": "50"})
    assert reply.status_code == 503
    message = reply.json()["error"]
    assert "'m5' is not loaded on this worker" in message and "deadline" in message
    assert int(reply.headers["retry-after"]) >= 1
    assert metric(url, "tailserve_cold_requests_total", model="m5", outcome="refused") == 1
    wait_for(
        lambda: httpx.get(f"{url}/v2/models/m5/ready").status_code == 200,
        what="m5 loaded by the refused request's demand",
    )
    # The OIP timeout parameter (µs) counts as a deadline too: m0 unloaded for m5.
    tight = {**X, "parameters": {"timeout": 20_000}}
    assert httpx.post(f"{url}{infer('m0')}", json=tight).status_code == 503
    wait_for(lambda: httpx.get(f"{url}/v2/models/m0/ready").status_code == 200, what="m0")
    # KServe v1 records reach a cold model as well (m1 unloaded for m0), with the SLO (1 s).
    reply = httpx.post(f"{url}/v1/models/m1:predict", json={"instances": [{"x": 2.0}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["predictions"] == [5.0]


def test_concurrent_requests_for_a_cold_model_share_one_load(budgeted: WorkerProcess) -> None:
    url = budgeted.url
    loads_before = metric(url, "tailserve_model_load_seconds_count", model="m5")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(
                lambda _: httpx.post(
                    f"{url}{infer('m5')}", json=X, headers={"X-Deadline-Ms": "10000"}, timeout=20
                ),
                range(8),
            )
        )
    assert [r.status_code for r in replies] == [200] * 8
    assert metric(url, "tailserve_model_load_seconds_count", model="m5") == loads_before + 1
    assert metric(url, "tailserve_cold_requests_total", model="m5", outcome="waited") == 8
    assert metric(url, "tailserve_models_loaded") == 5


def test_without_a_budget_every_model_loads_at_start(tmp_path: Path) -> None:
    repository = ballasted_repository(tmp_path / "repo", NAMES)
    with worker_process(repository, tmp_path) as worker:
        assert metric(worker.url, "tailserve_models_loaded") == 6
        assert metric(worker.url, "tailserve_model_memory_budget_bytes") == 0
        # What each costs is measured all the same.
        assert metric(worker.url, "tailserve_model_memory_bytes", model="m3") >= 16 * 2**20
