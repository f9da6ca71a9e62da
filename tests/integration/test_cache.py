"""The result cache through real workers on loopback, with a real Redis."""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.models import add_version, doubler_config, write_model
from support.servers import (
    RedisServer,
    RunningRedisCluster,
    RunningWorker,
    flush_redis,
    free_port,
    run_worker,
    wait_for,
)
from tailserve.settings import Settings


def cached_config(**cache: Any) -> dict[str, Any]:
    config = doubler_config(
        inputs=[
            {"name": "x", "datatype": "FP32", "shape": [1]},
            {"name": "noise", "datatype": "FP32", "shape": [1], "optional": True},
        ],
        cache={"enabled": True, "ttl_s": 60, "key": {"exclude": ["noise"]}, **cache},
    )
    return config


def body(x: float, *, noise: float | None = None, **parameters: Any) -> dict[str, Any]:
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]
    if noise is not None:
        inputs.append({"name": "noise", "datatype": "FP32", "shape": [1, 1], "data": [noise]})
    return {"inputs": inputs, "parameters": parameters}


def infer(url: str, payload: dict[str, Any], model: str = "m", **kw: Any) -> httpx.Response:
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=payload, timeout=30, **kw)
    assert response.status_code == 200, response.text
    return response


def source(response: httpx.Response) -> str:
    value: str = response.json()["parameters"]["cache"]
    assert response.headers["x-cache"] == value
    return value


def runs(url: str, model: str = "m") -> int:
    document = httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()
    return sum(int(d["execution_count"]) for d in document["model_stats"])


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    write_model(tmp_path, "m", cached_config())
    return tmp_path


@pytest.fixture
def worker(repository: Path) -> Iterator[RunningWorker]:
    with run_worker(Settings(repository=str(repository))) as running:
        yield running


def test_a_repeated_request_is_answered_from_l1_without_running_the_model(
    worker: RunningWorker,
) -> None:
    first = infer(worker.url, body(1.5))
    second = infer(worker.url, body(1.5))
    assert (source(first), source(second)) == ("miss", "l1")
    assert first.json()["outputs"] == second.json()["outputs"]
    parameters = second.json()["parameters"]
    assert parameters["batch_size"] == 0 and parameters["cache_computed_by"]
    assert runs(worker.url) == 1
    # An excluded input does not split the cache; another x does.
    assert source(infer(worker.url, body(1.5, noise=7.0))) == "l1"
    assert source(infer(worker.url, body(2.5))) == "miss"
    assert runs(worker.url) == 2


def test_a_bad_input_the_key_leaves_out_is_refused_on_a_hit_as_on_a_miss(
    worker: RunningWorker,
) -> None:
    # noise is left out of the key: a request whose noise is malformed shares the key of a
    # good one, and must still get the 400 its miss would get, not the cached answer.
    infer(worker.url, body(4.5))
    bad = body(4.5)
    bad["inputs"].append({"name": "noise", "datatype": "FP32", "shape": [1, 1], "data": ["loud"]})
    refused = httpx.post(f"{worker.url}/v2/models/m/infer", json=bad, timeout=30)
    assert refused.status_code == 400 and "noise" in refused.json()["error"], refused.text
    wrong_shape = body(4.5)
    wrong_shape["inputs"].append(
        {"name": "noise", "datatype": "FP32", "shape": [2, 1], "data": [1.0, 2.0]}
    )
    refused = httpx.post(f"{worker.url}/v2/models/m/infer", json=wrong_shape, timeout=30)
    assert refused.status_code == 400, refused.text
    assert source(infer(worker.url, body(4.5, noise=1.0))) == "l1"


def test_cache_modes_by_parameter_and_header(worker: RunningWorker) -> None:
    infer(worker.url, body(3.0))
    assert source(infer(worker.url, body(3.0, cache="bypass"))) == "bypass"
    assert source(infer(worker.url, body(3.0), headers={"x-cache-mode": "refresh"})) == "refresh"
    assert source(infer(worker.url, body(3.0))) == "l1"
    assert runs(worker.url) == 3
    bad = httpx.post(f"{worker.url}/v2/models/m/infer", json=body(3.0, cache="sometimes"))
    assert bad.status_code == 400 and "'cache'" in bad.json()["error"]


def test_identical_concurrent_requests_run_the_model_once(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    config = cached_config()
    config["parameters"] = {"gate": str(gate)}
    write_model(tmp_path, "m", config, code=_HELD)
    with run_worker(Settings(repository=str(tmp_path))) as running:
        before = runs(running.url)
        with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
            futures = [pool.submit(infer, running.url, body(4.0)) for _ in range(100)]
            # Every request is in (one computing, 99 waiting on it) before the model may finish.
            wait_for(
                lambda: _metric(running.url, "tailserve_cache_coalesced_requests") >= 99,
                what="99 requests coalesced",
            )
            gate.touch()
            sources = [source(f.result()) for f in futures]
        assert sources.count("miss") == 1 and sources.count("coalesced") == 99
        assert runs(running.url) - before == 1


def test_a_hit_is_answered_while_the_model_is_too_busy_for_a_miss(tmp_path: Path) -> None:
    config = cached_config()
    # 200 ms a batch: the backlog lasts long enough to be seen even when the eight requests
    # trickle in from a busy machine (at 50 ms each ran alone as it came, under xdist).
    config.update(parameters={"delay": 0.2}, max_batch_size=4, batching={"max_queue_size": 64})
    write_model(tmp_path, "m", config)
    with run_worker(Settings(repository=str(tmp_path))) as running:
        url = running.url
        infer(url, body(9.0))  # computed once: a hit from now on
        stats_url = f"{url}/v2/models/m/stats"

        def queued() -> int:
            count: int = httpx.get(stats_url).json()["model_stats"][0]["batching"]["queued"]
            return count

        tight = {"X-Deadline-Ms": "300"}  # more than a batch alone, less than the queue
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            # Eight 4-row misses, ~200 ms a batch: ~1.6 s of work queued ahead.
            misses = [
                {
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "FP32",
                            "shape": [4, 1],
                            "data": [float(i), 0.5, 0.25, 0.125],
                        }
                    ]
                }
                for i in range(8)
            ]
            backlog = [
                pool.submit(
                    httpx.post,
                    f"{url}/v2/models/m/infer",
                    json=m,
                    headers={"X-Deadline-Ms": "10000"},  # room to wait out the whole backlog
                    timeout=30,
                )
                for m in misses
            ]
            wait_for(lambda: queued() >= 4, what="a backlog to build")
            hit = httpx.post(f"{url}/v2/models/m/infer", json=body(9.0), headers=tight)
            miss = httpx.post(f"{url}/v2/models/m/infer", json=body(10.0), headers=tight)
            assert hit.status_code == 200, hit.text
            assert source(hit) == "l1"
            # The miss still needs the model, and is refused for its deadline.
            assert miss.status_code == 429, miss.text
            assert "queued ahead" in miss.json()["error"]
            assert all(f.result().status_code == 200 for f in backlog)


def test_a_new_version_changes_every_key(repository: Path) -> None:
    with run_worker(Settings(repository=str(repository))) as running:
        first = infer(running.url, body(1.0))
        assert source(infer(running.url, body(1.0))) == "l1"
        add_version(repository / "m", 2)
        assert httpx.post(f"{running.url}/v2/repository/models/m/load").status_code == 200
        after = infer(running.url, body(1.0))
        assert source(after) == "miss"
        assert after.json()["model_version"] == "2"
        assert after.json()["outputs"][0]["data"] != first.json()["outputs"][0]["data"]


def test_stale_is_served_then_refreshed(tmp_path: Path) -> None:
    # Each entry stays fresh for a second: longer than a loaded machine takes between two of
    # the test's requests, so no request but the one the test waits for finds it stale.
    write_model(tmp_path, "m", cached_config(ttl_s=1.0, stale_s=60))
    with run_worker(Settings(repository=str(tmp_path))) as running:
        assert "cache_computed_at" not in infer(running.url, body(5.0)).json()["parameters"]
        computed = infer(running.url, body(5.0)).json()["parameters"]["cache_computed_at"]
        wait_for(lambda: source(infer(running.url, body(5.0))) == "stale", what="TTL to pass")
        wait_for(lambda: _computed_at(running.url) > computed, what="background refresh")
        assert runs(running.url) == 2


def test_invalidation_needs_a_target_and_reports_what_it_dropped(worker: RunningWorker) -> None:
    infer(worker.url, body(6.0))
    wrong = httpx.post(f"{worker.url}/v2/cache/invalidate", json={"prefix": "nope"})
    assert wrong.status_code == 400 and "prefix" in wrong.json()["error"]
    for version in ("abc", True, [1]):  # a bad field of the body: 400, not an unknown model
        bad = httpx.post(
            f"{worker.url}/v2/cache/invalidate", json={"model": "m", "version": version}
        )
        assert bad.status_code == 400 and "'version' must be a whole number" in bad.text, bad.text
    empty = httpx.post(f"{worker.url}/v2/cache/invalidate", json={})
    assert empty.status_code == 400
    done = httpx.post(f"{worker.url}/v2/cache/invalidate", json={"model": "m"}).json()
    assert done["l1"] == 1 and done["prefix"] == "ts:{m}:"
    assert source(infer(worker.url, body(6.0))) == "miss"


def test_invalidation_is_an_admin_route(repository: Path) -> None:
    with run_worker(Settings(repository=str(repository), admin_token="s3cret")) as running:
        denied = httpx.post(f"{running.url}/v2/cache/invalidate", json={"model": "m"})
        assert denied.status_code == 401
        allowed = httpx.post(
            f"{running.url}/v2/cache/invalidate",
            json={"model": "m"},
            headers={"authorization": "Bearer s3cret"},
        )
        assert allowed.status_code == 200


# --- with Redis ---------------------------------------------------------------------------------


@pytest.fixture
def redis(redis: RedisServer) -> RedisServer:
    """The session's Redis, emptied: these tests count and drop keys."""
    flush_redis(redis.url)
    return redis


def with_redis(repository: Path, redis: RedisServer, **changes: Any) -> Settings:
    # A lookup that waits past its Redis budget counts as a miss, and a loaded test machine
    # can stall a worker past the default 5 ms: these tests check sharing, not Redis's speed.
    changes.setdefault("cache_l2_budget_ms", 1000)
    return Settings(repository=str(repository), redis_url=redis.url, **changes)


def test_l2_shares_results_between_workers_and_fills_l1(
    repository: Path, redis: RedisServer
) -> None:
    with (
        run_worker(with_redis(repository, redis, worker_id="a")) as a,
        run_worker(with_redis(repository, redis, worker_id="b")) as b,
    ):
        assert source(infer(a.url, body(7.25))) == "miss"
        wait_for(lambda: _keys(redis) == 1, what="a's result to be written to Redis")
        hit = infer(b.url, body(7.25))
        assert source(hit) == "l2"
        assert hit.json()["parameters"]["cache_computed_by"] == "a"
        assert source(infer(b.url, body(7.25))) == "l1"
        assert runs(b.url) == 0


def test_invalidation_reaches_the_other_workers_l1(repository: Path, redis: RedisServer) -> None:
    with (
        run_worker(with_redis(repository, redis, worker_id="a")) as a,
        run_worker(with_redis(repository, redis, worker_id="b")) as b,
    ):
        wait_for(
            lambda: a.worker.cache.subscribed.is_set() and b.worker.cache.subscribed.is_set(),
            what="both workers subscribed",
        )
        infer(a.url, body(8.5))
        infer(b.url, body(8.5))
        assert source(infer(b.url, body(8.5))) == "l1"
        report = httpx.post(f"{a.url}/v2/cache/invalidate", json={"model": "m", "version": 1})
        assert report.json()["published"] is True and report.json()["l2"] >= 1
        wait_for(
            lambda: b.worker.cache.invalidations_received >= 1,
            timeout=1.0,
            what="the invalidation to reach worker b within a second",
        )
        assert source(infer(b.url, body(8.5))) == "miss"


def test_a_redis_lease_coalesces_across_workers(tmp_path: Path, redis: RedisServer) -> None:
    gate = tmp_path / "gate"
    config = cached_config(lease_ms=5000)
    config["parameters"] = {"gate": str(gate)}
    write_model(tmp_path, "m", config, code=_HELD)
    with (
        run_worker(with_redis(tmp_path, redis, worker_id="a")) as a,
        run_worker(with_redis(tmp_path, redis, worker_id="b")) as b,
    ):
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            first = pool.submit(infer, a.url, body(9.0))
            wait_for(lambda: _busy(a.url) > 0, what="a to compute")
            second = pool.submit(infer, b.url, body(9.0))
            wait_for(
                lambda: _metric(b.url, "tailserve_cache_lookups", 'tier="l2"') >= 1,
                what="b to miss L2 and find the lease taken",
            )
            gate.touch()
            assert source(first.result()) == "miss"
            assert source(second.result()) == "coalesced"
        assert runs(a.url) + runs(b.url) == 1


# --- helpers ------------------------------------------------------------------------------------

# A batch holding x = 4 or 9 waits for a gate file (warm-up's random inputs never do).
_HELD = """
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.gate = Path(config.parameters["gate"]) if "gate" in config.parameters else None

    def predict(self, inputs):
        x = inputs["x"]
        if self.gate is not None and np.isin(x, [4.0, 9.0]).any():
            deadline = time.monotonic() + 20
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.002)
        return {"y": (x * 2).astype(np.float32)}
"""


def _computed_at(url: str) -> float:
    response = infer(url, body(5.0))
    return float(response.json()["parameters"].get("cache_computed_at", 0.0))


def _metric(url: str, name: str, where: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#") and where in line:
            if "_created" in line.split(" ")[0]:
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


def _keys(redis: RedisServer) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return len(client.keys("ts:*"))
    finally:
        client.close()


def _busy(url: str) -> int:
    document = httpx.get(f"{url}/v2/models/m/stats", timeout=10).json()
    return sum(
        d["batching"]["queued"] + d["batching"]["busy_instances"] for d in document["model_stats"]
    )


def test_redis_killed_and_restarted_costs_no_request(tmp_path: Path, repository: Path) -> None:
    port = free_port()
    server = _start_redis(tmp_path, port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        settings = Settings(repository=str(repository), redis_url=url, worker_id="a")
        with run_worker(settings) as running:
            assert source(infer(running.url, body(10.0))) == "miss"
            server.kill()
            server.wait()
            # Every request still succeeds (L1 and the model); the breaker opens.
            values = iter(range(1000))
            for _ in range(10):
                infer(running.url, body(100.0 + next(values)))
            wait_for(lambda: _breaker(running.url) == "open", what="the breaker to open")
            assert source(infer(running.url, body(10.0))) == "l1"
            # What L2 did without, by reason: lookups that failed (refused connections) until
            # the breaker opened, then lookups and writes not sent at all.
            skipped = _l2_skipped(running.url)
            assert skipped.get(("lookup", "error"), 0) >= 1
            assert skipped.get(("lookup", "breaker"), 0) >= 1
            assert skipped.get(("write", "breaker"), 0) >= 1
            server = _start_redis(tmp_path, port)

            # Probes go out with traffic; one succeeds once Redis is back and closes it.
            def closed() -> bool:
                infer(running.url, body(100.0 + next(values)))
                return _breaker(running.url) == "closed"

            wait_for(closed, what="the breaker to close")
            assert source(infer(running.url, body(11.0))) == "miss"
            wait_for(lambda: _redis_keys(url) >= 1, what="writes to reach Redis again")
    finally:
        server.kill()
        server.wait()


def _start_redis(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed"
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _redis_keys(f"redis://127.0.0.1:{port}/0") >= 0, what="redis-server")
    return process


def _redis_keys(url: str) -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return len(client.keys("ts:*"))
    except redis_py.ConnectionError:
        return -1
    finally:
        client.close()


def _l2_skipped(url: str) -> dict[tuple[str, str], float]:
    """``tailserve_cache_l2_skipped_total`` by (operation, reason), from the worker's metrics."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name == "tailserve_cache_l2_skipped":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["operation"], sample.labels["reason"])
                    found[key] = sample.value
    return found


def _breaker(url: str) -> str:
    document = httpx.get(f"{url}/v2/models/m/stats", timeout=10).json()
    state: str = document["model_stats"][0]["cache"]["l2"]["breaker"]
    return state


def test_workers_share_results_and_invalidations_on_a_redis_cluster(
    repository: Path, redis_cluster: RunningRedisCluster
) -> None:
    def settings(worker_id: str, node: int) -> Settings:
        # As with_redis: a generous budget, since this checks sharing, not the cluster's speed
        # (a loaded machine made b's first lookup, which opens a connection, a skipped miss).
        return Settings(
            repository=str(repository),
            redis_url=redis_cluster.node_url(node),
            redis_cluster=True,
            worker_id=worker_id,
            cache_l2_budget_ms=1000,
        )

    with run_worker(settings("a", 0)) as a, run_worker(settings("b", 2)) as b:
        wait_for(
            lambda: a.worker.cache.subscribed.is_set() and b.worker.cache.subscribed.is_set(),
            what="both workers subscribed",
        )
        assert source(infer(a.url, body(12.5))) == "miss"
        assert _breaker(a.url) == "closed"
        wait_for(lambda: _cluster_has_result(redis_cluster), what="a's write to reach the cluster")
        assert source(infer(b.url, body(12.5))) == "l2"
        assert source(infer(b.url, body(12.5))) == "l1"
        report = httpx.post(f"{a.url}/v2/cache/invalidate", json={"model": "m"}).json()
        assert report["published"] is True and report["l2"] == 1
        wait_for(
            lambda: b.worker.cache.invalidations_received >= 1,
            timeout=1.0,
            what="the invalidation to reach worker b within a second",
        )
        assert source(infer(b.url, body(12.5))) == "miss"


def _cluster_has_result(cluster: RunningRedisCluster) -> bool:
    import redis as redis_py

    client = redis_py.RedisCluster.from_url(cluster.url)
    try:
        return any(True for _ in client.scan_iter(match="ts:{m}:*", count=10_000))
    finally:
        client.close()
