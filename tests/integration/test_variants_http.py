"""A model with variants through a real worker on loopback: which variant served each request,
pinning one by name, the accuracy floor, the metrics and the cache's account, over HTTP and
gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from prometheus_client.parser import text_string_to_metric_families

from support.models import DOUBLER, doubler_config, write_model
from support.servers import RunningWorker, free_port, run_worker
from tailserve.settings import Settings

# The cheap variant: y = 2x + bias + 1000, so a test can tell which one ran.
CHEAP = DOUBLER.replace("(x * 2 + self.bias)", "(x * 2 + self.bias + 1000)")


def variants_config(**changes: Any) -> dict[str, Any]:
    return doubler_config(
        variants={
            "metric": "auc",
            "floor": 0.8,
            "choices": [
                {"name": "fp32", "accuracy": 0.95},
                {"name": "int8", "artifact": "cheap.py", "accuracy": 0.94},
                # Below the floor: never loaded, never served.
                {"name": "tiny", "artifact": "tiny.py", "accuracy": 0.6},
            ],
        },
        **changes,
    )


def write_variants(repository: Path, name: str, config: dict[str, Any]) -> None:
    folder = write_model(repository, name, config)
    (folder / "1" / "cheap.py").write_text(CHEAP)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningWorker, str]]:
    repository = tmp_path_factory.mktemp("variants")
    write_variants(repository, "m", variants_config())
    write_variants(repository, "cached", variants_config(cache={"enabled": True, "ttl_s": 60}))
    port = free_port()
    with run_worker(Settings(repository=str(repository), grpc_port=port)) as running:
        yield running, f"127.0.0.1:{port}"


def infer(url: str, x: float, model: str = "m", **kw: Any) -> httpx.Response:
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}],
        "parameters": kw.pop("parameters", {}),
    }
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30, **kw)


def test_a_quiet_worker_serves_the_most_accurate_variant_and_says_which(
    served: tuple[RunningWorker, str],
) -> None:
    url = served[0].url
    response = infer(url, 1.0)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["parameters"]["variant"] == "fp32"
    assert response.headers["x-variant"] == "fp32"
    assert reply["outputs"][0]["data"] == [3.0]


def test_a_request_may_pin_a_variant_by_parameter_or_header(
    served: tuple[RunningWorker, str],
) -> None:
    url = served[0].url
    by_parameter = infer(url, 1.0, parameters={"variant": "int8"})
    by_header = infer(url, 1.0, headers={"x-variant": "int8"})
    for response in (by_parameter, by_header):
        assert response.status_code == 200, response.text
        assert response.headers["x-variant"] == "int8"
        assert response.json()["outputs"][0]["data"] == [1003.0]


def test_an_unknown_or_floored_variant_is_a_400_naming_those_serving(
    served: tuple[RunningWorker, str],
) -> None:
    url = served[0].url
    for name in ("bogus", "tiny"):
        response = infer(url, 1.0, parameters={"variant": name})
        assert response.status_code == 400
        assert f"no variant {name!r} serving (serving: fp32, int8)" in response.json()["error"]
    assert infer(url, 1.0, parameters={"variant": 8}).status_code == 400
    assert infer(url, 1.0).status_code == 200  # and it keeps serving


def test_the_metrics_count_requests_by_variant(served: tuple[RunningWorker, str]) -> None:
    url = served[0].url

    def counts() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "tailserve_variant_requests":
                for sample in family.samples:
                    if sample.labels["model"] == "m" and sample.name.endswith("_total"):
                        found[sample.labels["variant"]] = sample.value
        return found

    before = counts()
    # The dial picks an unpinned request's variant (fp32 on a quiet worker, int8 where the
    # machine is busy): it is counted under the one its reply names.
    chosen = infer(url, 2.0).json()["parameters"]["variant"]
    infer(url, 2.0, parameters={"variant": "int8"})
    infer(url, 2.0, parameters={"variant": "int8"})
    after = counts()
    expected = {"fp32": 0, "int8": 2}
    expected[chosen] += 1
    assert {name: after.get(name, 0) - before.get(name, 0) for name in expected} == expected


def test_a_cached_answer_names_the_variant_that_computed_it(
    served: tuple[RunningWorker, str],
) -> None:
    url = served[0].url
    first = infer(url, 5.0, model="cached", parameters={"variant": "int8"})
    again = infer(url, 5.0, model="cached")
    assert first.headers["x-cache"] == "miss"
    assert again.headers["x-cache"] == "l1"
    assert again.headers["x-variant"] == "int8"
    assert again.json()["outputs"][0]["data"] == [1011.0]


def test_grpc_carries_the_variant_both_ways(served: tuple[RunningWorker, str]) -> None:
    client = triton_grpc.InferenceServerClient(served[1])
    tensor = triton_grpc.InferInput("x", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
    result = client.infer("m", [tensor], parameters={"variant": "int8"})
    assert result.as_numpy("y").tolist() == [[1003.0]]
    assert result.get_response().parameters["variant"].string_param == "int8"
    client.close()


def test_a_floor_no_variant_meets_is_a_load_error_naming_the_field(tmp_path: Path) -> None:
    config = variants_config()
    config["variants"]["floor"] = 0.99
    write_variants(tmp_path, "m", config)
    with run_worker(Settings(repository=str(tmp_path)), wait_ready=True) as running:
        reply = httpx.get(f"{running.url}/v2/models/m/ready", timeout=10)
        assert reply.status_code != 200
        index = httpx.post(f"{running.url}/v2/repository/index", json={}, timeout=10).json()
        assert "variants.floor" in index[0]["reason"]
