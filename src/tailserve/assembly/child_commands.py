"""The command lines of the processes `tailserve up` runs, and what it reads of the machine and
the repository to write them."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tailserve.errors import ConfigError
from tailserve.fleet.processes import LOOPBACK, ManagedWorker
from tailserve.modelconfig import load_model_config
from tailserve.repository.discovery import model_dirs

if TYPE_CHECKING:
    from tailserve.assembly.stack import FleetConfig

# A model whose config cannot be read is routed with this SLO (its workers say what is wrong).
DEFAULT_SLO_MS = 1000.0


def worker_command(config: FleetConfig, worker: ManagedWorker) -> list[str]:
    """`tailserve serve` on the worker's loopback ports."""
    return [
        sys.executable,
        "-m",
        "tailserve.cli",
        "serve",
        "--repository",
        config.repository,
        "--host",
        LOOPBACK,
        "--http-port",
        str(worker.port),
        "--grpc-port",
        str(worker.grpc_port),
        "--worker-id",
        worker.name,
        "--drain-timeout",
        str(config.drain_timeout_s),
        "--log-level",
        config.log_level,
        *config.worker_args,
    ]


def lane_command(config: FleetConfig, lane: ManagedWorker, backends_file: Path) -> list[str]:
    """`tailserve route` (the hedging lane) over the workers listed in ``backends_file``, which
    it watches (the supervisor rewrites it as workers enter and leave the rotation)."""
    return [
        sys.executable,
        "-m",
        "tailserve.cli",
        "route",
        "--host",
        LOOPBACK,
        "--port",
        str(lane.port),
        "--grpc-port",
        "0",
        "--log-level",
        config.log_level,
        "--backends-file",
        str(backends_file),
        *config.lane_args,
    ]


def descriptor_limit() -> int:
    """The most file descriptors this process may open (its hard limit)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return hard if hard != resource.RLIM_INFINITY else 1 << 20


def repository_models(repository: Path) -> dict[str, float]:
    """Each model of the repository, with its SLO (p99, ms)."""
    models = {}
    for name, directory in model_dirs(repository).items():
        try:
            models[name] = float(load_model_config(directory).slo.p99_ms)
        except ConfigError:
            models[name] = DEFAULT_SLO_MS
    return models
