"""`tailserve warm`: a real worker records a trace; a fresh worker is warmed from it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from support.models import doubler_config, write_model
from support.servers import RedisServer, flush_redis, run_worker, wait_for
from tailserve.cli import main
from tailserve.settings import Settings

# x: how many times the recorded traffic asks for it.
SKEW = {1.0: 6, 2.0: 4, 3.0: 2, 4.0: 1, 5.0: 1}


@pytest.fixture
def redis(redis: RedisServer) -> RedisServer:
    """The session's Redis, emptied: a worker must not find another test's results."""
    flush_redis(redis.url)
    return redis


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "m", doubler_config(cache={"enabled": True, "ttl_s": 60}))
    return repo


def body(x: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}


def infer(url: str, x: float, **headers: str) -> httpx.Response:
    response = httpx.post(f"{url}/v2/models/m/infer", json=body(x), headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response


def computed(url: str) -> int:
    """Rows the model ran (concurrent requests may share one execution)."""
    document = httpx.get(f"{url}/v2/models/m/stats", timeout=10).json()
    return int(document["model_stats"][0]["inference_count"])


def lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def stored(redis: RedisServer) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return sum(1 for _ in client.scan_iter(match="ts:{m}:*", count=10_000))
    finally:
        client.close()


@pytest.fixture
def trace(repository: Path, redis: RedisServer, tmp_path: Path) -> Iterator[Path]:
    """Skewed traffic recorded by a worker that shares the test's Redis."""
    path = tmp_path / "trace.jsonl"
    settings = Settings(
        repository=str(repository), redis_url=redis.url, trace_file=str(path), trace_sample=1.0
    )
    with run_worker(settings) as recorder:
        for x, count in SKEW.items():
            for i in range(count):
                # A deadline does not make a request another one.
                infer(recorder.url, x, **({"X-Deadline-Ms": "900"} if i % 2 else {}))
        wait_for(lambda: lines(path) == sum(SKEW.values()), what="the trace to be written")
        wait_for(lambda: stored(redis) == len(SKEW), what="the results to reach Redis")
    yield path


def warm(trace: Path, url: str, *extra: str) -> int:
    return main(["warm", str(trace), "--target", url, *extra])


def test_warm_fills_a_fresh_workers_l1_with_the_most_frequent_requests(
    trace: Path, repository: Path, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # A wide Redis budget: a lookup past it counts as a miss, and the test shares the GIL.
    settings = Settings(repository=str(repository), redis_url=redis.url, cache_l2_budget_ms=1000)
    with run_worker(settings) as fresh:
        assert warm(trace, fresh.url, "--top", "2") == 0
        out = capsys.readouterr().out
        assert "14 recorded requests, 5 distinct; replayed the top 2 (10 of the recorded" in out
        # The recording worker stored every result in Redis: the fresh one finds them there.
        assert "sent 2: 2 answered from the cache already, 0 computed, 0 errors" in out
        assert "(x-cache: l2 2)" in out
        assert infer(fresh.url, 1.0).headers["x-cache"] == "l1"
        assert infer(fresh.url, 2.0).headers["x-cache"] == "l1"
        assert infer(fresh.url, 5.0).headers["x-cache"] == "l2"  # rare: not warmed into L1
        assert computed(fresh.url) == 0


def test_warm_makes_a_worker_without_the_results_compute_them(
    trace: Path, repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with run_worker(Settings(repository=str(repository))) as fresh:  # no Redis: nothing shared
        assert warm(trace, fresh.url, "--top", "2", "--concurrency", "2") == 0
        assert "sent 2: 0 answered from the cache already, 2 computed" in capsys.readouterr().out
        assert computed(fresh.url) == 2
        assert infer(fresh.url, 1.0).headers["x-cache"] == "l1"
        assert infer(fresh.url, 2.0).headers["x-cache"] == "l1"
        assert infer(fresh.url, 4.0).headers["x-cache"] == "miss"
        assert computed(fresh.url) == 3


def test_warm_counts_errors_and_names_a_bad_trace_line(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def line(path: str, x: float) -> bytes:
        encoded = base64.b64encode(orjson.dumps(body(x))).decode()
        headers = {"content-type": "application/json"}
        return (
            orjson.dumps(
                {"t": 1.0, "method": "POST", "path": path, "headers": headers, "body": encoded}
            )
            + b"\n"
        )

    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(line("/v2/models/absent/infer", 1.0) * 3 + line("/v2/models/m/infer", 1.0))
    with run_worker(Settings(repository=str(repository))) as worker:
        assert warm(trace, worker.url) == 1
        captured = capsys.readouterr()
        assert "sent 2: 0 answered from the cache already, 1 computed, 1 errors" in captured.out
        assert "POST /v2/models/absent/infer: HTTP 404" in captured.err
        trace.write_bytes(trace.read_bytes() + b'{"t": 2.0, "method": "POST"}\n')
        assert warm(trace, worker.url) == 2
        assert f"{trace}:5: not a trace line" in capsys.readouterr().err
