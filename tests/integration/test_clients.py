"""Existing clients against the example repository: tritonclient.http unchanged, KServe v1."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import yaml

from support.churn import FIELDS, columns
from support.servers import RunningWorker, run_worker
from tailserve.examples.churn import sample_rows
from tailserve.settings import Settings


@pytest.fixture(scope="module")
def worker(example_repository: Path) -> Iterator[RunningWorker]:
    with run_worker(Settings(repository=str(example_repository))) as running:
        yield running


def triton_infer(
    client: Any, model: str, rows: int, *, binary: bool, seed: int = 3
) -> np.ndarray[Any, Any]:
    inputs = []
    for name, array in columns(rows, seed).items():
        tensor = triton.InferInput(name, list(array.shape), FIELDS[name])
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    outputs = [triton.InferRequestedOutput("churn_probability", binary_data=binary)]
    result = client.infer(model, inputs, outputs=outputs)
    probabilities: np.ndarray[Any, Any] = result.as_numpy("churn_probability")
    return probabilities


def test_tritonclient_health_metadata_and_config(worker: RunningWorker) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{worker.port}")
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("churn")
    assert client.is_model_ready("churn_lgbm")
    meta = client.get_server_metadata()
    assert meta["name"] == "tailserve"
    model = client.get_model_metadata("churn")
    assert {i["name"] for i in model["inputs"]} == set(FIELDS)
    assert all(i["shape"] == [-1, 1] for i in model["inputs"])
    assert client.get_model_config("churn")["max_batch_size"] > 0
    client.close()


@pytest.mark.parametrize("model", ["churn", "churn_lgbm"])
@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_infer_json_and_binary_agree(
    worker: RunningWorker, model: str, binary: bool
) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{worker.port}")
    probabilities = triton_infer(client, model, 5, binary=binary)
    other = triton_infer(client, model, 5, binary=not binary)
    client.close()
    assert probabilities.shape == (5, 1)
    assert probabilities.dtype == np.float32
    assert ((probabilities >= 0) & (probabilities <= 1)).all()
    np.testing.assert_allclose(probabilities, other, rtol=1e-6)


def test_tritonclient_sees_a_bad_value_as_an_error_naming_the_field(worker: RunningWorker) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{worker.port}")
    data = columns(2)
    data["tenure_months"][1, 0] = 500
    inputs = []
    for name, array in data.items():
        tensor = triton.InferInput(name, list(array.shape), FIELDS[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    with pytest.raises(triton.InferenceServerException, match="tenure_months"):
        client.infer("churn", inputs)
    client.close()


def records(rows: int) -> list[dict[str, Any]]:
    sample = sample_rows(rows, 11)
    return [{name: _plain(sample[name][i]) for name in FIELDS} for i in range(rows)]


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def test_kserve_v1_records_match_v2(worker: RunningWorker) -> None:
    instances = records(4)
    reply = httpx.post(f"{worker.url}/v1/models/churn:predict", json={"instances": instances})
    assert reply.status_code == 200, reply.text
    predictions = reply.json()["predictions"]
    assert len(predictions) == 4
    assert all(0.0 <= p <= 1.0 for p in predictions)
    assert reply.headers["x-model-version"] == "1"
    v2 = {
        "inputs": [
            {
                "name": name,
                "datatype": FIELDS[name],
                "shape": [4, 1],
                "data": [record[name] for record in instances],
            }
            for name in FIELDS
        ]
    }
    expected = httpx.post(f"{worker.url}/v2/models/churn/infer", json=v2).json()
    np.testing.assert_allclose(predictions, expected["outputs"][0]["data"], rtol=1e-6)
    status = httpx.get(f"{worker.url}/v1/models/churn").json()
    assert status == {"name": "churn", "ready": True}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("plan_tier"), "instances[0]: missing field 'plan_tier'"),
        (lambda r: r.update(colour="red"), "instances[0]: unknown field 'colour'"),
        (lambda r: r.update(contract_type="weekly"), "unknown value 'weekly'"),
        (lambda r: r.update(feature_usage_pct=1.5), "'feature_usage_pct': value 1.5"),
        (lambda r: r.update(tenure_months="ten"), "'tenure_months'"),
    ],
)
def test_kserve_v1_bad_records_name_the_field(
    worker: RunningWorker, change: Any, message: str
) -> None:
    instances = records(2)
    change(instances[0])
    reply = httpx.post(f"{worker.url}/v1/models/churn:predict", json={"instances": instances})
    assert reply.status_code == 400
    assert message in reply.json()["error"]
    for bad in (b"{}", b'{"instances": []}', b'{"instances": [1]}', b"nope"):
        reply = httpx.post(f"{worker.url}/v1/models/churn:predict", content=bad)
        assert reply.status_code == 400
        assert reply.json()["error"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests(worker: RunningWorker, algorithm: str) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{worker.port}")
    inputs = []
    for name, array in columns(3).items():
        tensor = triton.InferInput(name, list(array.shape), FIELDS[name])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    plain = client.infer("churn", inputs).as_numpy("churn_probability")
    packed = client.infer("churn", inputs, request_compression_algorithm=algorithm)
    client.close()
    np.testing.assert_allclose(packed.as_numpy("churn_probability"), plain, rtol=1e-6)


def _churn_with_inline_bound(example_repository: Path, into: Path, bound_ms: float) -> Path:
    shutil.copytree(example_repository / "churn", into / "churn")
    config_path = into / "churn" / "model.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["instances"]["inline_below_ms"] = bound_ms
    config_path.write_text(yaml.safe_dump(config))
    return into


def test_a_small_onnx_models_batches_run_on_the_event_loop_with_the_same_answers(
    example_repository: Path, tmp_path: Path
) -> None:
    # churn's batches take a fraction of a millisecond: below instances.inline_below_ms, they
    # run on the loop's thread rather than being handed to the instance's (scheduler.py). The
    # bound is raised to 5 ms here so that a slow test machine's batches are still below it;
    # beside it, a worker whose bound is 0 hands every batch to the thread.
    on_loop = _churn_with_inline_bound(example_repository, tmp_path / "loop", 5.0)
    in_thread = _churn_with_inline_bound(example_repository, tmp_path / "thread", 0.0)
    with (
        run_worker(Settings(repository=str(on_loop))) as loop_worker,
        run_worker(Settings(repository=str(in_thread))) as thread_worker,
    ):

        def inline(url: str) -> int:
            stats = httpx.get(f"{url}/v2/models/churn/stats").json()["model_stats"][0]
            count: int = stats["batching"]["inline_batches"]
            return count

        loop_client = triton.InferenceServerClient(loop_worker.url.removeprefix("http://"))
        thread_client = triton.InferenceServerClient(thread_worker.url.removeprefix("http://"))
        for seed in range(100, 106):  # new inputs each time: computed, not found in the cache
            probabilities = triton_infer(loop_client, "churn", 4, binary=True, seed=seed)
            assert probabilities.shape == (4, 1)
            expected = triton_infer(thread_client, "churn", 4, binary=True, seed=seed)
            np.testing.assert_array_equal(probabilities, expected)
        assert inline(loop_worker.url) == 6 and inline(thread_worker.url) == 0
