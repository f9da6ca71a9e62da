"""Stale if overloaded, through a real worker on loopback: a value past its TTL is computed
afresh while the model is quiet, and answered as stale while the model refuses requests."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.models import doubler_config, write_model
from support.servers import RunningWorker, run_worker, wait_for
from tailserve.settings import Settings

TTL_S = 0.3


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[RunningWorker]:
    config = doubler_config(
        max_batch_size=1,
        warmup={"batch_sizes": [1]},
        parameters={"delay": 0.05},  # 50 ms a request: a few in flight overload it
        cache={"enabled": True, "ttl_s": TTL_S, "stale_if_overloaded_s": 60},
    )
    write_model(tmp_path, "m", config)
    with run_worker(Settings(repository=str(tmp_path))) as running:
        yield running


def infer(url: str, x: float, **headers: str) -> httpx.Response:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]
    }
    return httpx.post(f"{url}/v2/models/m/infer", json=body, headers=headers, timeout=30)


def expire(response: httpx.Response) -> None:
    """Wait until the value that ``response`` stored is past its TTL (wall clock)."""
    computed = response.json()["parameters"].get("cache_computed_at", time.time())
    wait_for(lambda: time.time() > computed + TTL_S + 0.05, what="the TTL to pass")


def test_a_quiet_model_computes_an_expired_value_afresh(worker: RunningWorker) -> None:
    url = worker.url
    assert infer(url, 1.0).headers["x-cache"] == "miss"
    hit = infer(url, 1.0)
    assert hit.headers["x-cache"] == "l1"
    expire(hit)
    assert infer(url, 1.0).headers["x-cache"] == "miss"


def test_an_overloaded_model_answers_an_expired_value_as_stale(worker: RunningWorker) -> None:
    url = worker.url
    assert infer(url, 2.0).headers["x-cache"] == "miss"
    hit = infer(url, 2.0)
    expire(hit)
    # 60 unique requests at once, each with 120 ms to live: the model (50 ms each) refuses
    # most of them, and counts as overloaded while its refusals are recent.
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        flood = list(
            pool.map(lambda i: infer(url, 100.0 + i, **{"x-deadline-ms": "120"}), range(60))
        )
    refused = sum(r.status_code == 429 for r in flood)
    assert refused >= 30, [r.status_code for r in flood]
    stale = infer(url, 2.0)
    assert stale.status_code == 200
    assert stale.headers["x-cache"] == "stale"
    assert stale.json()["outputs"][0]["data"] == [5.0]  # 2x + 1
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'result="stale_overloaded"' in metrics
