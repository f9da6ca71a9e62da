"""Models that hold a known amount of memory, for the memory budget's tests: each allocates
``ballast_mb`` MiB when it loads (and sleeps ``load_s`` first), and its version folder holds a
file of that size, so its estimate before a load and its measure after agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.models import doubler_config, write_model

BALLASTED = """
import time

import numpy as np


class Model:
    def __init__(self, version_dir, config):
        time.sleep(float(config.parameters.get("load_s", 0.0)))
        size = int(config.parameters.get("ballast_mb", 0)) * 2**20
        self.ballast = np.ones(size, dtype=np.uint8)

    def predict(self, inputs):
        return {"y": (inputs["x"] * 2 + 1).astype(np.float32)}
"""

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}


def ballasted_repository(
    root: Path, names: list[str], *, ballast_mb: int = 16, load_s: float = 0.0, **config: Any
) -> Path:
    for name in names:
        parameters = {"ballast_mb": ballast_mb, "load_s": load_s}
        changes = {"parameters": parameters, "warmup": {"batch_sizes": [1]}, **config}
        folder = write_model(root, name, doubler_config(**changes), code=BALLASTED)
        (folder / "1" / "ballast.bin").write_bytes(b"\0" * (ballast_mb * 2**20))
    return root


def infer(model: str) -> str:
    return f"/v2/models/{model}/infer"
