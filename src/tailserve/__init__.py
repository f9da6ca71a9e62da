"""tailserve: a low-latency machine-learning serving system.

The public API is small: a worker (`Worker`) built from one `Settings`, the error tree, and the
example repository writer. Everything else is reached through the command line or the
protocols.
"""

import os

# ONNX Runtime (1.29 on) sends usage events to Microsoft from every process that loads it,
# Linux included, unless this is set before it starts: a server sends nothing anywhere it was
# not asked to. (Set it to 0 to let ONNX Runtime send them.)
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from tailserve.errors import TailserveError
from tailserve.settings import Settings, load_settings
from tailserve.version import __version__

__all__ = ["Settings", "TailserveError", "Worker", "__version__", "load_settings"]


def __getattr__(name: str) -> object:
    # The worker pulls in its HTTP server and the runtimes: import it only when asked for.
    if name == "Worker":
        from tailserve.assembly.worker import Worker

        return Worker
    raise AttributeError(f"module 'tailserve' has no attribute {name!r}")
