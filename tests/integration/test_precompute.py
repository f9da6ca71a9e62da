"""`tailserve precompute` against a real Redis, read back by a real worker."""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from support.models import doubler_config, write_model
from support.servers import RedisServer, flush_redis, run_worker, wait_for
from tailserve.cli import main
from tailserve.examples import load_features
from tailserve.settings import Settings

# A model of three datatypes and a row of three values: score = n + len(s) + sum(v).
MIXED = """
import numpy as np


class Model:
    def predict(self, inputs):
        n = inputs["n"].astype(np.float32)
        s = np.array([[len(x)] for x in inputs["s"].reshape(-1)], dtype=np.float32)
        v = inputs["v"].sum(axis=1, keepdims=True)
        return {"score": (n + s + v).astype(np.float32)}
"""


def mixed_config() -> dict[str, Any]:
    return doubler_config(
        inputs=[
            {"name": "n", "datatype": "INT64", "shape": [1], "range": [0, 100]},
            {"name": "s", "datatype": "BYTES", "shape": [1], "values": ["ab", "abcd"]},
            {"name": "v", "datatype": "FP32", "shape": [3]},
        ],
        outputs=[{"name": "score", "datatype": "FP32", "shape": [1]}],
        cache={"enabled": True, "ttl_s": 60},
    )


@pytest.fixture
def redis(redis: RedisServer) -> RedisServer:
    """The session's Redis, emptied: these tests count keys."""
    flush_redis(redis.url)
    return redis


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    write_model(repo, "m", doubler_config(cache={"enabled": True, "ttl_s": 60}))
    write_model(repo, "mixed", mixed_config(), code=MIXED)
    return repo


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_bytes(
        b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines)
    )
    return path


def precompute(repository: Path, model: str, source: Path, redis: RedisServer, *extra: str) -> int:
    return main(
        [
            "precompute",
            "--repository",
            str(repository),
            "--model",
            model,
            "--input",
            str(source),
            "--redis-url",
            redis.url,
            *extra,
        ]
    )


def keys(redis: RedisServer, model: str = "m") -> int:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        return sum(1 for _ in client.scan_iter(match=f"ts:{{{model}}}:*", count=10_000))
    finally:
        client.close()


def serving(repository: Path, redis: RedisServer) -> Settings:
    # A lookup that waits past its Redis budget counts as a miss; these tests share the GIL
    # with the worker, so the budget is wide: they check keys, not Redis's latency.
    return Settings(repository=str(repository), redis_url=redis.url, cache_l2_budget_ms=1000)


def v2(x: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}


def infer(url: str, payload: dict[str, Any], model: str = "m") -> httpx.Response:
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=payload, timeout=30)
    assert response.status_code == 200, response.text
    return response


def executions(url: str, model: str = "m") -> int:
    document = httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()
    return int(document["model_stats"][0]["execution_count"])


def test_precomputed_results_are_served_without_running_the_model(
    repository: Path, redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 40 lines in batches of 32: more than the model's largest batch (16), and a short last one.
    source = write_lines(tmp_path / "in.jsonl", [{"x": i + 0.5} for i in range(40)])
    assert precompute(repository, "m", source, redis, "--batch-size", "32") == 0
    out = capsys.readouterr()
    assert "precomputed 40 results for m v1" in out.out
    assert "40/40 (100%)" in out.err  # the progress line, on stderr
    assert keys(redis) == 40
    with run_worker(serving(repository, redis)) as worker:
        answer = infer(worker.url, v2(3.5))
        document = answer.json()
        assert document["parameters"]["cache"] == "precomputed"
        assert answer.headers["x-cache"] == "precomputed"
        assert document["parameters"]["cache_computed_by"] == "precompute"
        assert document["outputs"][0]["data"] == [8.0]  # 2 * 3.5 + bias 1
        # The same request as KServe v1 records, and as binary tensors, finds the same key.
        v1 = httpx.post(
            f"{worker.url}/v1/models/m:predict", json={"instances": [{"x": 39.5}]}, timeout=30
        )
        assert v1.status_code == 200, v1.text
        assert (v1.headers["x-cache"], v1.json()["predictions"]) == ("precomputed", [80.0])
        header = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [1, 1],
                        "parameters": {"binary_data_size": 4},
                    }
                ]
            }
        )
        binary = httpx.post(
            f"{worker.url}/v2/models/m/infer",
            content=header + struct.pack("<f", 17.5),
            headers={"Inference-Header-Content-Length": str(len(header))},
            timeout=30,
        )
        assert binary.status_code == 200, binary.text
        assert binary.headers["x-cache"] == "precomputed"
        assert executions(worker.url) == 0
        # An input that was not precomputed runs the model (the count above could move).
        assert infer(worker.url, v2(1000.0)).json()["parameters"]["cache"] == "miss"
        assert executions(worker.url) == 1


def test_every_datatype_keys_as_the_worker_does(
    repository: Path, redis: RedisServer, tmp_path: Path
) -> None:
    records = [{"n": 3, "s": "ab", "v": [0.5, 1.0, 1.5]}, {"n": 7, "s": "abcd", "v": [1, 2, 3]}]
    source = write_lines(tmp_path / "in.jsonl", records)
    assert precompute(repository, "mixed", source, redis, "--quiet") == 0
    with run_worker(serving(repository, redis)) as worker:
        request = {
            "inputs": [
                {"name": "n", "datatype": "INT64", "shape": [1, 1], "data": [7]},
                {"name": "s", "datatype": "BYTES", "shape": [1, 1], "data": ["abcd"]},
                {"name": "v", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]},
            ]
        }
        answer = infer(worker.url, request, "mixed").json()
        assert answer["parameters"]["cache"] == "precomputed"
        assert answer["outputs"][0]["data"] == [17.0]  # 7 + 4 + 6
        v1 = httpx.post(
            f"{worker.url}/v1/models/mixed:predict", json={"instances": records[:1]}, timeout=30
        )
        assert (v1.headers["x-cache"], v1.json()["predictions"]) == ("precomputed", [8.0])
        assert executions(worker.url, "mixed") == 0


def test_a_bad_line_stops_after_the_lines_before_it_and_a_rerun_resumes_there(
    repository: Path, redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[Any] = [{"x": float(i)} for i in range(1, 11)]
    lines[5] = {"x": "six"}  # line 6, in the middle of the third batch of two
    source = write_lines(tmp_path / "in.jsonl", lines)
    checkpoint = tmp_path / "done.json"
    options = ("--batch-size", "2", "--checkpoint", str(checkpoint))
    assert precompute(repository, "m", source, redis, *options) == 2
    error = capsys.readouterr().err
    assert f"{source}:6: field 'x'" in error
    assert "resume at line 6" in error
    assert orjson.loads(checkpoint.read_bytes())["lines_done"] == 5
    assert keys(redis) == 5
    # Fix the line, forget what was stored: the rerun writes lines 6-10 and only those.
    lines[5] = {"x": 6.0}
    write_lines(source, lines)
    redis_flush(redis)
    assert precompute(repository, "m", source, redis, *options) == 0
    assert "precomputed 5 results for m v1" in capsys.readouterr().out
    assert keys(redis) == 5
    with run_worker(serving(repository, redis)) as worker:
        assert infer(worker.url, v2(6.0)).json()["parameters"]["cache"] == "precomputed"
        assert infer(worker.url, v2(10.0)).json()["parameters"]["cache"] == "precomputed"
        assert infer(worker.url, v2(5.0)).json()["parameters"]["cache"] == "miss"
    # Done: the same checkpoint makes a third run store nothing.
    assert precompute(repository, "m", source, redis, *options) == 0
    assert "precomputed 0 results" in capsys.readouterr().out
    assert orjson.loads(checkpoint.read_bytes())["complete"] is True


def redis_flush(redis: RedisServer) -> None:
    import redis as redis_py

    client = redis_py.Redis.from_url(redis.url)
    try:
        client.flushall()
    finally:
        client.close()


def test_skip_bad_counts_bad_lines_and_stores_the_rest(
    repository: Path, redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {"n": 1, "s": "ab", "v": [1, 2, 3]}
    lines: list[Any] = [
        good,
        {**good, "z": 1},  # 2: an unknown field
        {"n": 1, "s": "ab"},  # 3: a missing field
        {**good, "n": 500},  # 4: out of the model's range
        b"{not json",  # 5
        b"",  # 6: blank, not a record
        {**good, "s": "abcd"},
    ]
    source = write_lines(tmp_path / "in.jsonl", lines)
    assert precompute(repository, "mixed", source, redis, "--skip-bad") == 0
    out = capsys.readouterr()
    assert "precomputed 2 results" in out.out
    assert "4 bad lines passed over" in out.out
    for expected in (
        ":2: unknown field 'z'",
        ":3: missing field 'v'",
        ":4: input 'n': value 500",
        ":5: not valid JSON",
    ):
        assert expected in out.err
    assert keys(redis, "mixed") == 2


def test_errors_name_the_line_and_field_from_the_command_line(
    repository: Path, redis: RedisServer, tmp_path: Path
) -> None:
    source = write_lines(tmp_path / "in.jsonl", [{"x": 1.0}, {"x": [1.0, 2.0]}])
    command = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "precompute",
        "--repository",
        str(repository),
        "--model",
        "m",
        "--input",
        str(source),
        "--redis-url",
        redis.url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert f"tailserve: {source}:2: field 'x': shape [1, 1] needs 1 elements" in done.stderr
    assert keys(redis) == 1  # line 1, stored before the bad line stopped the job


def test_a_model_that_never_reads_the_cache_is_refused(
    tmp_path: Path, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    write_model(tmp_path / "repo", "plain", doubler_config())
    source = write_lines(tmp_path / "in.jsonl", [{"x": 1.0}])
    assert precompute(tmp_path / "repo", "plain", source, redis) == 2
    assert "model 'plain' does not cache" in capsys.readouterr().err
    assert keys(redis, "plain") == 0


def test_a_signal_stops_after_the_batch_in_hand_and_the_checkpoint_resumes(
    tmp_path: Path, redis: RedisServer
) -> None:
    repository = tmp_path / "repo"
    slow = doubler_config(cache={"enabled": True}, parameters={"delay": 0.01})  # 10 ms a batch
    write_model(repository, "slow", slow)
    source = write_lines(tmp_path / "in.jsonl", [{"x": float(i)} for i in range(300)])
    checkpoint = tmp_path / "done.json"
    command = [
        sys.executable,
        "-m",
        "tailserve.cli",
        "precompute",
        "--repository",
        str(repository),
        "--model",
        "slow",
        "--input",
        str(source),
        "--redis-url",
        redis.url,
        "--batch-size",
        "1",
        "--checkpoint",
        str(checkpoint),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: checkpoint.exists() or process.poll() is not None, what="a first batch")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert "stopped by a signal after line" in out
    done = orjson.loads(checkpoint.read_bytes())["lines_done"]
    assert 0 < done < 300
    assert keys(redis, "slow") == done  # every stored line is checkpointed, and only those
    assert precompute(repository, "slow", source, redis, "--checkpoint", str(checkpoint)) == 0
    assert keys(redis, "slow") == 300


FAILS_ON_NEGATIVE = """
import numpy as np


class Model:
    def predict(self, inputs):
        x = inputs["x"]
        if (x < 0).any():
            raise ValueError("negative input")
        return {"y": (x * 2).astype(np.float32)}
"""


def test_a_model_failure_names_the_lines_of_its_batch(
    tmp_path: Path, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    write_model(
        tmp_path / "repo", "picky", doubler_config(cache={"enabled": True}), code=FAILS_ON_NEGATIVE
    )
    source = write_lines(tmp_path / "in.jsonl", [{"x": 1.0}, {"x": 2.0}, {"x": 3.0}, {"x": -1.0}])
    assert precompute(tmp_path / "repo", "picky", source, redis, "--batch-size", "2") == 2
    error = capsys.readouterr().err
    assert f"{source}: lines 3-4: the model failed:" in error
    assert "negative input" in error
    assert keys(redis, "picky") == 2  # the first batch


def test_entity_ids_are_scored_through_the_feature_store_and_served_as_precomputed(
    example_repository: Path, redis: RedisServer, tmp_path: Path
) -> None:
    # The ranker's records name a user and candidate items; precompute looks their features
    # up as a worker does, and a worker asked the same ids answers without running the model.
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "ranker", repo / "ranker")
    load_features(repo / "ranker", redis.url)
    lines = [
        {"user_id": 7, "item_ids": [1, 2, 3]},
        {"user_id": [8], "item_ids": 4},
        {"user_id": 9, "item_ids": [5, 999_999]},
    ]
    source = write_lines(tmp_path / "ids.jsonl", lines)
    assert precompute(repo, "ranker", source, redis, "--skip-bad") == 0
    assert keys(redis, "ranker") == 2  # the third names an item the store does not hold
    with run_worker(serving(repo, redis)) as worker:
        for user, items in ((7, [1, 2, 3]), (8, [4])):
            body = {
                "inputs": [
                    {"name": "user_id", "datatype": "INT64", "shape": [1, 1], "data": [user]},
                    {
                        "name": "item_ids",
                        "datatype": "INT64",
                        "shape": [len(items), 1],
                        "data": items,
                    },
                ]
            }
            hit = infer(worker.url, body, "ranker")
            assert hit.headers["x-cache"] == "precomputed", hit.text
            fresh = infer(worker.url, {**body, "parameters": {"cache": "bypass"}}, "ranker")
            scores = [o["data"] for o in hit.json()["outputs"]]
            assert scores == [o["data"] for o in fresh.json()["outputs"]]
            assert len(scores[0]) == len(items)
