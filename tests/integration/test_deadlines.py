"""Deadlines, priorities, cost classes and statistics through a real worker on loopback."""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import tritonclient.http as triton

from support.models import doubler_config, write_model
from support.servers import RunningWorker, run_worker, wait_for
from tailserve.settings import Settings


@contextlib.contextmanager
def posters(count: int) -> Iterator[Callable[..., concurrent.futures.Future[httpx.Response]]]:
    """``post(url, **options)`` from ``count`` threads through one client, for a backlog: its
    connections' TLS context is set up once, so the requests go out together. A client each
    (``httpx.post``) spends tens of milliseconds of the GIL setting one up, one thread at a time:
    on a slow machine a backlog of 50 ms batches then drains faster than it builds."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    with (
        httpx.Client(timeout=30, limits=limits) as client,
        concurrent.futures.ThreadPoolExecutor(count) as pool,
    ):

        def post(url: str, **options: Any) -> concurrent.futures.Future[httpx.Response]:
            return pool.submit(client.post, url, **options)

        yield post


# Real requests (values of 1 and more; warm-up draws them from [0, 1)) wait for a gate file before
# their batch runs, and each batch they start is noted.
HELD = """
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.gate = Path(config.parameters["gate"])
        self.marks = Path(config.parameters["marks"])

    def predict(self, inputs):
        if inputs["x"].max() >= 1.0:
            with self.marks.open("a") as marks:
                marks.write(f"{len(inputs['x'])}\\n")
            deadline = time.monotonic() + 20
            while not self.gate.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""

# Counts each row's tokens that are not padding (0), and notes the shapes it was given.
COUNTER = """
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.shapes = Path(config.parameters["shapes"])

    def predict(self, inputs):
        tokens = inputs["tokens"]
        with self.shapes.open("a") as out:
            out.write(f"{tokens.shape[0]} {tokens.shape[1]}\\n")
        return {"count": (tokens != 0).sum(axis=1, keepdims=True).astype(np.int64)}
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("files")
    return {name: folder / name for name in ("gate", "marks", "shapes")}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Iterator[Any]:
    repo = tmp_path_factory.mktemp("repo")
    write_model(
        repo,
        "slow",
        doubler_config(
            parameters={"delay": 0.05},
            max_batch_size=4,
            slo={"p99_ms": 1000},
            batching={"priority_levels": 2, "max_queue_size": 64},
            warmup={"batch_sizes": [1, 4], "repeat": 3},
        ),
    )
    write_model(
        repo,
        "tight",
        doubler_config(
            parameters={"delay": 0.2},
            max_batch_size=4,
            slo={"p99_ms": 200},
            batching={"max_queue_size": 64},
            warmup={"batch_sizes": [1, 4], "repeat": 3},
        ),
    )
    write_model(
        repo,
        "held",
        doubler_config(
            parameters={"gate": str(files["gate"]), "marks": str(files["marks"])},
            warmup={"batch_sizes": [1], "repeat": 2},
            slo={"p99_ms": 5000},
        ),
        code=HELD,
    )
    write_model(
        repo,
        "counter",
        {
            "runtime": "python",
            "max_batch_size": 8,
            "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [-1]}],
            "outputs": [{"name": "count", "datatype": "INT64", "shape": [1]}],
            "batching": {"pad_value": 0, "cost": {"by": "tokens", "edges": [8, 32]}},
            "warmup": {"batch_sizes": [1, 2], "repeat": 2},
            "parameters": {"shapes": str(files["shapes"])},
        },
        code=COUNTER,
    )
    with run_worker(Settings(repository=str(repo))) as running:
        yield running


def body(values: list[float], **parameters: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(values), 1], "data": values}]
    }
    if parameters:
        document["parameters"] = parameters
    return document


def test_a_deadline_that_cannot_be_met_is_refused_with_429(worker: RunningWorker) -> None:
    url = f"{worker.url}/v2/models/slow/infer"
    # A batch of this model takes ~50 ms: 10 ms is refused before anything runs.
    refused = httpx.post(url, json=body([1.0]), headers={"X-Deadline-Ms": "10"})
    assert refused.status_code == 429, refused.text
    assert "cannot be met" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    by_parameter = httpx.post(url, json=body([1.0], timeout=10_000))  # µs, as Triton names it
    assert by_parameter.status_code == 429
    # The tighter of the two wins.
    both = httpx.post(url, json=body([1.0], timeout=10_000), headers={"X-Deadline-Ms": "5000"})
    assert both.status_code == 429
    served = httpx.post(url, json=body([1.0], timeout=2_000_000), headers={"X-Deadline-Ms": "900"})
    assert served.status_code == 200 and served.json()["outputs"][0]["data"] == [3.0]
    metrics = httpx.get(f"{worker.url}/metrics").text
    assert 'tailserve_rejected_requests_total{model="slow",reason="deadline"} 3.0' in metrics
    batching = httpx.get(f"{worker.url}/v2/models/slow/stats").json()["model_stats"][0]["batching"]
    assert batching["rejected"]["deadline"] >= 3
    assert "a batch of its 1 row(s) alone takes" in batching["recent_rejections"][-1]
    # Refusals of deadlines that nothing could meet are not overload: the full share stands.
    assert batching["admission_share"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"headers": {"X-Deadline-Ms": "soon"}}, "X-Deadline-Ms must be a positive number"),
        ({"headers": {"X-Deadline-Ms": "-3"}}, "X-Deadline-Ms must be a positive number"),
        ({"headers": {"X-Deadline-Ms": "inf"}}, "X-Deadline-Ms must be a positive number"),
        ({"headers": {"X-Deadline-Ms": "NaN"}}, "X-Deadline-Ms must be a positive number"),
        ({"parameters": {"timeout": -5}}, "parameter 'timeout'"),
        ({"parameters": {"timeout": "1s"}}, "parameter 'timeout'"),
        ({"parameters": {"priority": 3}}, "parameter 'priority' must be a whole number in 1..2"),
        ({"parameters": {"priority": "high"}}, "parameter 'priority'"),
        ({"headers": {"X-Priority": "first"}}, "X-Priority must be a whole number"),
    ],
)
def test_bad_deadlines_and_priorities_are_400_naming_them(
    worker: RunningWorker, kwargs: dict[str, Any], message: str
) -> None:
    document = body([1.0], **kwargs.get("parameters", {}))
    reply = httpx.post(
        f"{worker.url}/v2/models/slow/infer", json=document, headers=kwargs.get("headers", {})
    )
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]
    ok = httpx.post(f"{worker.url}/v2/models/slow/infer", json=body([1.0], priority=1))
    assert ok.status_code == 200


def test_deadlines_far_beyond_any_need_are_served_and_the_model_keeps_serving(
    worker: RunningWorker,
) -> None:
    # Budgets no float arithmetic should meet raw (1e308 ms; a timeout of 400 digits, which
    # is no float at all): they count as a day, and the model's scheduler lives on.
    url = f"{worker.url}/v2/models/slow/infer"
    huge = httpx.post(url, json=body([1.0]), headers={"X-Deadline-Ms": "1e308"})
    assert huge.status_code == 200, huge.text
    endless = httpx.post(
        url,
        content=b'{"inputs": [{"name": "x", "datatype": "FP32", '
        b'"shape": [1, 1], "data": [2.0]}], "parameters": {"timeout": ' + b"9" * 400 + b"}}",
    )
    assert endless.status_code == 200, endless.text
    after = httpx.post(url, json=body([3.0]), headers={"X-Deadline-Ms": "900"}, timeout=10)
    assert after.status_code == 200, after.text


def test_a_client_deadline_expires_in_the_queue_and_an_slo_one_runs_late(
    worker: RunningWorker, files: dict[str, Path]
) -> None:
    url = f"{worker.url}/v2/models/held/infer"
    files["gate"].unlink(missing_ok=True)
    files["marks"].unlink(missing_ok=True)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(httpx.post, url, json=body([1.0]), timeout=30)
        # The first batch holds the only instance at the gate.
        wait_for(lambda: files["marks"].exists(), what="the first batch to start")
        hard = pool.submit(
            httpx.post, url, json=body([2.0]), headers={"X-Deadline-Ms": "150"}, timeout=30
        )
        soft = pool.submit(httpx.post, url, json=body([3.0]), timeout=30)

        def queued() -> int:
            stats = httpx.get(f"{worker.url}/v2/models/held/stats").json()
            count: int = stats["model_stats"][0]["batching"]["queued"]
            return count

        wait_for(lambda: queued() == 2, what="both to wait behind the held batch")
        time.sleep(0.3)  # past the 150 ms deadline while the instance is held
        files["gate"].touch()
        replies = [first.result(), hard.result(), soft.result()]
    assert [r.status_code for r in replies] == [200, 504, 200], [r.text for r in replies]
    assert "deadline can no longer be met" in replies[1].json()["error"]
    assert replies[2].json()["outputs"][0]["data"] == [6.0]
    # The expired request never reached the model: two batches ran after warm-up.
    assert files["marks"].read_text().split() == ["1", "1"]


def test_different_lengths_batch_in_their_class_padded_within_its_edge(
    worker: RunningWorker, files: dict[str, Path]
) -> None:
    files["shapes"].unlink(missing_ok=True)
    lengths = [3, 7, 5, 20, 1, 30, 8, 12]

    def call(n: int) -> int:
        document = {
            "inputs": [
                {
                    "name": "tokens",
                    "datatype": "INT64",
                    "shape": [1, n],
                    "data": list(range(1, n + 1)),
                }
            ]
        }
        # (A deadline of its own: the default SLO's 50 ms are not under test here, and eight
        # clients starting at once in this process can take them before the worker reads.)
        url = f"{worker.url}/v2/models/counter/infer"
        reply = httpx.post(url, json=document, headers={"X-Deadline-Ms": "10000"})
        assert reply.status_code == 200, reply.text
        edge = 8 if n <= 8 else 32
        assert reply.json()["parameters"]["cost_class"] == f"tokens<={edge}"
        assert reply.headers["x-cost-class"] == f"tokens<={edge}"
        data: list[int] = reply.json()["outputs"][0]["data"]
        return data[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        counts = list(pool.map(call, lengths))
    assert counts == lengths  # padding did not change any answer
    widths = {int(line.split()[1]) for line in files["shapes"].read_text().splitlines()}
    # Every batch padded to its longest rounded up to 8, within its class's edge: the lengths
    # over 8 (20, 30, 12) are in the class up to 32, and none is padded past it.
    assert widths <= {8, 16, 24, 32}


def test_statistics_in_tritons_shape_with_the_batching_state(worker: RunningWorker) -> None:
    for value in (1.0, 2.0, 3.0):
        assert httpx.post(f"{worker.url}/v2/models/slow/infer", json=body([value])).is_success
    client = triton.InferenceServerClient(worker.url.removeprefix("http://"))
    try:
        stats = client.get_inference_statistics("slow")
    finally:
        client.close()
    (model,) = stats["model_stats"]
    assert model["name"] == "slow" and model["version"] == "1"
    assert model["inference_count"] >= 3 and model["execution_count"] >= 1
    assert model["inference_stats"]["success"]["count"] >= 3
    assert model["inference_stats"]["queue"]["ns"] > 0
    assert sum(b["compute_infer"]["count"] for b in model["batch_stats"]) >= 1
    batching = model["batching"]
    assert batching["policy"] == "deadline"
    costs = batching["cost_model"]["all"]
    assert costs["observations"] >= 3
    assert 30 <= costs["predicted_ms"]["1"] <= 200  # the model sleeps 50 ms a batch
    every = httpx.get(f"{worker.url}/v2/models/stats").json()["model_stats"]
    assert {m["name"] for m in every} >= {"slow", "counter", "held"}
    assert httpx.get(f"{worker.url}/v2/models/nope/stats").status_code == 404


@contextlib.contextmanager
def backlog(
    worker: RunningWorker, model: str, *, requests: int = 8, ready: int = 4, **parameters: Any
) -> Iterator[str]:
    """``requests`` 4-row batches queued on ``model`` (slow's 50 ms or tight's 200 ms of work
    each ahead of anything new), each request with ``parameters``; yields the model's infer URL
    once at least ``ready`` wait, and checks on leaving that every one of them was served."""
    url = f"{worker.url}/v2/models/{model}/infer"
    stats_url = f"{worker.url}/v2/models/{model}/stats"

    def queued() -> int:
        count: int = httpx.get(stats_url).json()["model_stats"][0]["batching"]["queued"]
        return count

    with posters(requests) as post:
        waiting = [post(url, json=body([1.0] * 4, **parameters)) for _ in range(requests)]
        wait_for(lambda: queued() >= ready, what="a backlog to build")
        yield url
        assert all(f.result().status_code == 200 for f in waiting)


def test_a_busy_model_sheds_before_reading_the_body(worker: RunningWorker) -> None:
    with backlog(worker, "slow") as url:
        # Not even valid JSON: refused for its deadline before the body was read (a 400
        # would mean it was parsed).
        shed = httpx.post(url, content=b"{not json", headers={"X-Deadline-Ms": "100"})
        assert shed.status_code == 429, shed.text
        assert "queued ahead" in shed.json()["error"]
    assert httpx.post(url, content=b"{not json").status_code == 400


def test_a_body_timeout_looser_than_the_slo_is_left_to_admission(worker: RunningWorker) -> None:
    # The SLO is 200 ms and each of tight's batches takes 200 ms; the backlog's own requests
    # carry a 30 s timeout. At least three batches wait behind the one running (~600 ms ahead:
    # three times the SLO), so a batch that ends before the probe arrives (a slow machine)
    # still leaves more ahead than the SLO allows.
    with backlog(worker, "tight", requests=8, ready=3, timeout=30_000_000) as url:
        # No deadline but the SLO: refused before its body is parsed (it is no JSON at all).
        shed = httpx.post(url, content=b"{not json")
        assert shed.status_code == 429 and "queued ahead" in shed.json()["error"], shed.text
        # No header either, but a 10 s timeout in the body: looser than the SLO, so not
        # refused on the SLO's account; admission sees its real deadline and it is served.
        loose = httpx.post(url, json=body([2.0], timeout=10_000_000), timeout=30)
        assert loose.status_code == 200, loose.text
        assert loose.json()["outputs"][0]["data"] == [5.0]  # 2x + 1 (version 1)


def _exchange(conn: socket.socket, request: bytes) -> tuple[bytes, bytes]:
    """Send one request; read one response (head and a Content-Length body)."""
    conn.sendall(request)
    return _replies(conn, 1)[0]


def _replies(conn: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """Read ``count`` responses (heads and Content-Length bodies) from a connection."""
    data, replies = b"", []
    while len(replies) < count:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            assert chunk, f"connection closed after {len(replies)} replies"
            data += chunk
        head, data = data.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(data) < length:
            data += conn.recv(65536)
        replies.append((head, data[:length]))
        data = data[length:]
    return replies


def _pipelined(worker: RunningWorker, request: bytes, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` copies of ``request`` sent at once on one connection (answered in one stretch
    of the worker's loop); their replies."""
    host, port = worker.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(request * count)
        return _replies(conn, count)


def test_a_refusal_before_the_body_keeps_the_connection_in_step(worker: RunningWorker) -> None:
    payload = orjson.dumps(body([1.0]))

    def post(deadline_ms: int) -> bytes:
        return (
            b"POST /v2/models/slow/infer HTTP/1.1\r\nhost: t\r\n"
            b"content-type: application/json\r\nx-deadline-ms: %d\r\n"
            b"content-length: %d\r\n\r\n" % (deadline_ms, len(payload))
        )

    with backlog(worker, "slow"):
        host, port = worker.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            # Refused from its headers, its body sent all the same: the body is skipped and
            # the next request on the connection is read from where it begins.
            head, answer = _exchange(conn, post(100) + payload)
            assert head.startswith(b"HTTP/1.1 429"), head
            assert b"retry-after" in head.lower() and b"queued ahead" in answer
            head, answer = _exchange(conn, post(30_000) + payload)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert orjson.loads(answer)["outputs"][0]["data"] == [3.0]  # (slow: 2x + 1)


def test_an_overloaded_model_answers_a_burst_with_the_refusal_of_a_moment_ago(
    tmp_path: Path,
) -> None:
    # A worker of its own: the refusals take this model's admission share to its floor.
    write_model(
        tmp_path,
        "flooded",
        doubler_config(
            parameters={"delay": 0.05},
            max_batch_size=4,
            slo={"p99_ms": 1000},
            batching={"max_queue_size": 64},
            warmup={"batch_sizes": [1, 4], "repeat": 3},
        ),
    )
    count = 60
    refused = (
        b"POST /v2/models/flooded/infer HTTP/1.1\r\nhost: t\r\nx-deadline-ms: 100\r\n"
        b"content-length: 9\r\n\r\n{not json"
    )
    # (The backlog's own requests carry a 30 s timeout: let in whatever the share.)
    with (
        run_worker(Settings(repository=str(tmp_path))) as running,
        backlog(running, "flooded", timeout=30_000_000) as url,
    ):
        replies = _pipelined(running, refused, count)
        stats = httpx.get(f"{running.url}/v2/models/flooded/stats").json()
        batching = stats["model_stats"][0]["batching"]
        # Another kind of request (a looser deadline) is judged afresh, and let in.
        loose = httpx.post(url, json=body([1.0]), headers={"X-Deadline-Ms": "30000"}, timeout=30)
        assert loose.status_code == 200, loose.text
    # Every one refused before its body was read (it is no JSON), with why.
    assert all(head.startswith(b"HTTP/1.1 429") for head, _ in replies)
    assert all(b"queued ahead" in answer for _, answer in replies)
    # Past a fifth refused, the share at its floor: the later ones were answered with the
    # refusal of a moment ago, and counted as the model's refusals all the same.
    assert batching["admission_share"] == pytest.approx(0.3, abs=0.01)
    assert batching["refusals_reused"] >= 1
    assert batching["rejected"]["deadline"] == count


def test_under_overload_a_request_let_in_before_it_was_read_keeps_its_whole_time(
    tmp_path: Path,
) -> None:
    # A worker of its own: a flood takes this model's admission share to its floor (0.3).
    write_model(
        tmp_path,
        "crowded",
        doubler_config(
            parameters={"delay": 0.05},
            max_batch_size=4,
            slo={"p99_ms": 5000},
            batching={"priority_levels": 2, "max_queue_size": 64},
            warmup={"batch_sizes": [1, 4], "repeat": 3},
        ),
    )
    flood = (
        b"POST /v2/models/crowded/infer HTTP/1.1\r\nhost: t\r\nx-deadline-ms: 1\r\n"
        b"content-length: 9\r\n\r\n{not json"
    )
    with run_worker(Settings(repository=str(tmp_path))) as running:
        url = f"{running.url}/v2/models/crowded/infer"

        def stats() -> dict[str, Any]:
            document = httpx.get(f"{running.url}/v2/models/crowded/stats").json()
            batching: dict[str, Any] = document["model_stats"][0]["batching"]
            return batching

        # 16 batches of ~50 ms at the lower priority: at least 500 ms queued ahead.
        low = body([1.0] * 4, priority=2, timeout=30_000_000)
        with posters(16) as post:
            waiting = [post(url, json=low) for _ in range(16)]
            wait_for(lambda: stats()["queued"] >= 10, what="a backlog to build")
            replies = _pipelined(running, flood, 60)  # refused before they are read: no time
            assert all(head.startswith(b"HTTP/1.1 429") for head, _ in replies)
            assert stats()["admission_share"] == pytest.approx(0.3, abs=0.01)
            # At the door it is judged at the highest priority, with nothing queued ahead: let
            # in. Offered at its own priority, the backlog is ahead of it: more than the
            # share's 30% of its 1.5 s, less than all of it. Read and decoded, it keeps all.
            late = httpx.post(
                url, json=body([2.0], priority=2), headers={"X-Deadline-Ms": "1500"}, timeout=30
            )
            assert late.status_code == 200, late.text
            assert late.json()["outputs"][0]["data"] == [5.0]  # 2x + 1
            assert all(f.result().status_code == 200 for f in waiting)
        # A request the shed did not see (its deadline in the body: it is looked at only once
        # read) still has only the share of its time to queue.
        with posters(16) as post:
            waiting = [post(url, json=low) for _ in range(16)]
            wait_for(lambda: stats()["queued"] >= 10, what="a backlog to build")
            _pipelined(running, flood, 60)
            unseen = httpx.post(url, json=body([2.0], priority=2, timeout=1_500_000), timeout=30)
            assert unseen.status_code == 429, unseen.text
            assert all(f.result().status_code == 200 for f in waiting)
