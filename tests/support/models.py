"""Small model repositories for tests, written with the python runtime."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

# y = 2x + b, with b from the version folder's number; sleeps `delay` seconds per batch and can
# fail its load. Module-level counters let a test see how many batches ran.
DOUBLER = """
import threading
import time

import numpy as np

BATCHES = []
GATE = threading.Event()
GATE.set()


class Model:
    def __init__(self, version_dir, config):
        self.bias = float(version_dir.name)
        self.delay = float(config.parameters.get("delay", 0.0))
        if config.parameters.get("fail_load"):
            raise RuntimeError("this model refuses to load")

    def predict(self, inputs):
        x = inputs["x"]
        BATCHES.append(len(x))
        if self.delay:
            time.sleep(self.delay)
        return {"y": (x * 2 + self.bias).astype(np.float32)}
"""


def doubler_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "runtime": "python",
        "max_batch_size": 16,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
        "batching": {"max_queue_delay_ms": 2, "max_queue_size": 64},
        "warmup": {"batch_sizes": [1, 4]},
        # In-process test servers share the GIL with the test's client threads: a 50 ms SLO
        # (the default deadline) would turn that contention into refusals.
        "slo": {"p99_ms": 1000},
    }
    config.update(changes)
    return config


def write_model(
    repository: Path,
    name: str,
    config: dict[str, Any],
    *,
    versions: tuple[int, ...] = (1,),
    code: str = DOUBLER,
) -> Path:
    folder = repository / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for version in versions:
        add_version(folder, version, code)
    return folder


def add_version(folder: Path, version: int, code: str = DOUBLER) -> None:
    version_dir = folder / str(version)
    version_dir.mkdir(exist_ok=True)
    (version_dir / "model.py").write_text(textwrap.dedent(code))
