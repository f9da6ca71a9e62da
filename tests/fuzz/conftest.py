"""A real worker process serving the example repository, for the fuzz tests to hit, and the
line each run ends with: how many cases it tried and how many failed."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from support import fuzzing
from support.servers import WorkerProcess, worker_process


@pytest.fixture(scope="session")
def fuzz_worker(
    example_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """``tailserve serve`` on the examples, with an admin token (the admin routes then answer
    401 without it, as the document says)."""
    logs = tmp_path_factory.mktemp("fuzz-worker")
    repository = _fuzz_repository(example_repository, tmp_path_factory.mktemp("fuzz-models"))
    with worker_process(repository, logs, "--admin-token", fuzzing.ADMIN_TOKEN) as running:
        yield running
        # What the fuzzing did must not have taken the worker down.
        assert httpx.get(f"{running.url}/v2/health/live", timeout=5).status_code == 200


def _fuzz_repository(examples: Path, into: Path) -> Path:
    """churn (tabular, BYTES inputs), sentiment (token ids of any length) and rerank (a
    python pipeline) from the examples. sentiment without its variants and with a short
    warm-up: the same inputs to validate, ready in seconds rather than half a minute."""
    for name in fuzzing.FUZZ_MODELS:
        if name == "sentiment":
            continue
        shutil.copytree(examples / name, into / name)
    shutil.copytree(examples / "sentiment", into / "sentiment", ignore=_variants)
    config = yaml.safe_load((examples / "sentiment" / "model.yaml").read_text())
    del config["variants"]
    config["warmup"] = {"batch_sizes": [1, 8], "repeat": 1}
    (into / "sentiment" / "model.yaml").write_text(yaml.safe_dump(config))
    return into


def _variants(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n.startswith("model.") and n != "model.onnx"]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker process: its fuzz counts, for the summary the controller
    prints (tests/conftest.py)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["fuzz"] = {"cases": dict(fuzzing.CASES), "failures": dict(fuzzing.FAILURES)}
