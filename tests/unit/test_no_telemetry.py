"""ONNX Runtime (1.29 on) sends usage events to Microsoft from any process that loads it unless
``ORT_DISABLE_TELEMETRY`` is set before it starts; importing tailserve sets it, and a value the
user set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

# Records the variable as onnxruntime begins to load (what ONNX Runtime reads as it starts).
PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "onnxruntime":
            seen.append(os.environ.get("ORT_DISABLE_TELEMETRY"))
        return None
sys.meta_path.insert(0, Watch())
import tailserve.runtimes.onnx
print(seen)
"""


def probe(**env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environment, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_loading_the_onnx_runtime_through_tailserve_turns_its_telemetry_off() -> None:
    assert probe() == "['1']"


def test_a_users_own_setting_is_kept() -> None:
    assert probe(ORT_DISABLE_TELEMETRY="0") == "['0']"
