"""Workers of one slowable model for the router's tests: ``m``, y = 2x, max batch 1."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from support.models import doubler_config, write_model
from support.servers import WorkerProcess, worker_process

# y = 2x, slowed by the number of seconds in the version folder's `delay` file (read on every
# batch, so a test can slow one worker down mid-run); every row it runs is noted in `ran`.
SLOWABLE = """
from pathlib import Path
import time

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        self.dir = Path(version_dir)

    def predict(self, inputs):
        x = inputs["x"]
        with (self.dir / "ran").open("a") as ran:
            ran.write("".join(f"{v:g}\\n" for v in x.ravel()))
        delay = self.dir / "delay"
        if delay.exists():
            time.sleep(float(delay.read_text() or 0))
        return {"y": (x * 2).astype(np.float32)}
"""


def repository(root: Path, model: str = "m") -> Path:
    config = doubler_config(max_batch_size=1, slo={"p99_ms": 10_000}, warmup={"batch_sizes": [1]})
    config["batching"] = {"max_queue_delay_ms": 0, "max_queue_size": 256}
    write_model(root, model, config, code=SLOWABLE)
    return root


@contextlib.contextmanager
def workers(tmp: Path, count: int, *extra: str) -> Iterator[list[WorkerProcess]]:
    """``count`` workers, each with a repository of its own (``tmp``/repo{i})."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(worker_process(repository(tmp / f"repo{i}"), tmp, *extra))
            for i in range(count)
        ]


def model_dir(tmp: Path, index: int, model: str = "m") -> Path:
    return tmp / f"repo{index}" / model / "1"


def slow(tmp: Path, index: int, seconds: float, model: str = "m") -> None:
    (model_dir(tmp, index, model) / "delay").write_text(str(seconds))


def ran(tmp: Path, index: int) -> list[float]:
    path = model_dir(tmp, index) / "ran"
    return [float(v) for v in path.read_text().split()] if path.exists() else []
