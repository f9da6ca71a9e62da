"""The package's public names are the ones promised, and importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import tailserve


def test_public_names() -> None:
    assert sorted(tailserve.__all__) == [
        "Settings",
        "TailserveError",
        "Worker",
        "__version__",
        "load_settings",
    ]
    for name in tailserve.__all__:
        assert getattr(tailserve, name) is not None
    assert tailserve.Worker.__name__ == "Worker"


def test_import_does_not_load_the_server_stack() -> None:
    code = (
        "import sys, tailserve; "
        "print('tailserve.assembly.worker' in sys.modules, 'httptools' in sys.modules, "
        "'onnxruntime' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]
