"""The reply memo (cache/replies.py) through a real worker: a request asked again with the same
bytes gets the reply encoded for it before, counted as the L1 hit it is, and only while L1
still serves, fresh, the entry that reply came from."""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from support.models import doubler_config, write_model
from support.servers import RunningWorker, run_worker
from tailserve.settings import Settings

URL = "/v2/models/m/infer"


def cached_config() -> dict[str, Any]:
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1]}]
    return doubler_config(inputs=inputs, cache={"enabled": True, "ttl_s": 60})


def body(x: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}


def source(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    value: str = response.json()["parameters"]["cache"]
    assert response.headers["x-cache"] == value
    return value


def runs(url: str) -> int:
    document = httpx.get(f"{url}/v2/models/m/stats", timeout=10).json()
    return sum(int(d["execution_count"]) for d in document["model_stats"])


def _metric(url: str, name: str, where: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and where in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[RunningWorker]:
    write_model(tmp_path, "m", cached_config())
    with run_worker(Settings(repository=str(tmp_path))) as running:
        yield running


def _post(worker: RunningWorker, payload: bytes, **headers: str) -> httpx.Response:
    return httpx.post(worker.url + URL, content=payload, headers=headers, timeout=30)


def _memo_hits(worker: RunningWorker) -> float:
    return _metric(worker.url, "tailserve_cache_reply_memo_hits_total")


def _l1_hits(worker: RunningWorker) -> float:
    return _metric(worker.url, "tailserve_cache_lookups_total", 'result="hit"')


def test_the_same_bytes_asked_again_get_the_kept_reply(worker: RunningWorker) -> None:
    payload = orjson.dumps(body(1.25))
    first, second, third = (_post(worker, payload) for _ in range(3))
    assert [source(r) for r in (first, second, third)] == ["miss", "l1", "l1"]
    assert third.content == second.content
    assert third.headers["x-cache"] == "l1" and third.headers["x-batch-size"] == "0"
    assert _memo_hits(worker) == 1
    assert _l1_hits(worker) == 2  # the kept reply's request counts as the L1 hit it is
    assert runs(worker.url) == 1
    # The same input in other bytes (another spelling of the number) is its own request: the
    # whole path answers it, from the same L1 entry.
    other = orjson.dumps(body(1.25)).replace(b"1.25", b"1.250")
    assert source(_post(worker, other)) == "l1"
    assert _memo_hits(worker) == 1


def test_a_request_id_is_part_of_the_request(worker: RunningWorker) -> None:
    for _ in range(3):
        assert _post(worker, orjson.dumps({**body(2.0), "id": "a"})).json()["id"] == "a"
    assert _memo_hits(worker) == 1
    assert _post(worker, orjson.dumps({**body(2.0), "id": "b"})).json()["id"] == "b"
    assert _memo_hits(worker) == 1


def test_an_invalidated_entry_is_not_replayed(worker: RunningWorker) -> None:
    payload = orjson.dumps(body(3.0))
    for _ in range(3):
        _post(worker, payload)
    assert _memo_hits(worker) == 1
    done = httpx.post(f"{worker.url}/v2/cache/invalidate", json={"model": "m"}).json()
    assert done["l1"] == 1
    again = _post(worker, payload)
    assert source(again) == "miss"
    assert runs(worker.url) == 2
    assert _metric(worker.url, "tailserve_cache_reply_memo_stale_total") == 1
    assert _memo_hits(worker) == 1


def test_headers_the_whole_path_would_refuse_or_act_on_are_not_replayed(
    worker: RunningWorker,
) -> None:
    payload = orjson.dumps(body(4.0))
    for _ in range(3):
        _post(worker, payload)
    assert _memo_hits(worker) == 1
    refused = _post(worker, payload, **{"x-deadline-ms": "-5"})
    assert refused.status_code == 400 and "X-Deadline-Ms" in refused.text
    refused = _post(worker, payload, **{"x-priority": "high"})
    assert refused.status_code == 400 and "X-Priority" in refused.text
    refused = _post(worker, payload, **{"x-priority": "9"})  # out of the model's levels
    assert refused.status_code == 400 and "'priority'" in refused.text, refused.text
    assert source(_post(worker, payload, **{"x-cache-mode": "bypass"})) == "bypass"
    assert source(_post(worker, payload, **{"x-cache-mode": "refresh"})) == "refresh"
    assert runs(worker.url) == 3
    assert _memo_hits(worker) == 1
    # The refresh stored a new entry: the reply kept from the old one is not replayed (the
    # whole path answers from the new one and keeps its reply). Headers that change nothing
    # of the answer do not stop a replay.
    first, again = (_post(worker, payload, **{"x-deadline-ms": "500"}) for _ in range(2))
    assert source(first) == source(again) == "l1"
    assert _metric(worker.url, "tailserve_cache_reply_memo_stale_total") == 1
    assert _memo_hits(worker) == 2


def test_no_memo_when_it_is_off(tmp_path: Path) -> None:
    write_model(tmp_path, "m", cached_config())
    with run_worker(Settings(repository=str(tmp_path), reply_memo_mb=0)) as running:
        payload = orjson.dumps(body(5.0))
        replies = [httpx.post(running.url + URL, content=payload, timeout=30) for _ in range(3)]
        assert [source(r) for r in replies] == ["miss", "l1", "l1"]
        assert "tailserve_cache_reply_memo" not in httpx.get(f"{running.url}/metrics").text


def test_an_expired_entry_is_looked_up_once_and_counted_as_expired(tmp_path: Path) -> None:
    config = cached_config()
    # A TTL long enough for the three requests on a loaded machine; the test sleeps out what
    # is left of it (what is tested is what happens after it).
    config["cache"]["ttl_s"] = 1.0
    write_model(tmp_path, "m", config)
    with run_worker(Settings(repository=str(tmp_path))) as running:
        payload = orjson.dumps(body(6.0))
        replies = [httpx.post(running.url + URL, content=payload, timeout=30)]
        stored = time.monotonic()  # the entry was stored before this reply
        replies += [httpx.post(running.url + URL, content=payload, timeout=30) for _ in range(2)]
        assert [source(r) for r in replies] == ["miss", "l1", "l1"]
        time.sleep(max(0.0, stored + 1.1 - time.monotonic()))
        again = httpx.post(running.url + URL, content=payload, timeout=30)
        assert source(again) == "miss"
        lookups = "tailserve_cache_lookups_total"
        assert _metric(running.url, lookups, 'result="expired"') == 1
        assert _metric(running.url, lookups, 'result="cold"') == 1
        computations = "tailserve_cache_computations_total"
        assert _metric(running.url, computations, 'kind="recompute"') == 1


def test_a_replayed_gzip_request_is_traced_as_the_whole_path_traces_it(tmp_path: Path) -> None:
    from tailserve.observability.trace_log import read_trace

    write_model(tmp_path / "repo", "m", cached_config())
    trace = tmp_path / "trace.jsonl"
    settings = Settings(repository=str(tmp_path / "repo"), trace_file=str(trace))
    payload = gzip.compress(orjson.dumps(body(7.0)))
    with run_worker(settings) as running:
        for _ in range(3):
            reply = httpx.post(
                running.url + URL, content=payload, timeout=30, headers={"content-encoding": "gzip"}
            )
            assert reply.status_code == 200, reply.text
        assert _memo_hits(running) == 1
    traced = [e["body"] for e in read_trace(trace)]  # read_trace decodes base64
    assert traced == [orjson.dumps(body(7.0))] * 3
