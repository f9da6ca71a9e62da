"""tailserve: a low-latency machine-learning serving system.

The public API is small: a worker (`Worker`) built from one `Settings`, the error tree, and the
example repository writer. Everything else is reached through the command line or the
protocols.
"""

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
