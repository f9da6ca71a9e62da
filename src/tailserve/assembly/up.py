"""tailserve up: the whole stack on one machine.

tailserve up [--repository DIR] [--port 8080] [--grpc-port 8081] [--workers N] [--gpus auto]
             [--redis-url URL]

Starts N workers (default: one per GPU, else one per core) on loopback ports and the front door
(HAProxy) on the public ports, HTTP and gRPC; restarts a worker that dies, and on SIGTERM or
Ctrl-C drains the front door, then the workers. With GPUs, each worker sees one of them
(CUDA_VISIBLE_DEVICES), in turn. It listens on 127.0.0.1 unless --host says otherwise.
With no --repository it serves the example repository, building it in var/repository first.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailserve.assembly.child_commands import repository_models
from tailserve.assembly.scaling import ScalingPlan
from tailserve.cache.redis import parse_url, without_password
from tailserve.errors import ConfigError
from tailserve.fleet.autoscaler import ScalingConfig
from tailserve.fleet.gpus import detect_gpus, parse_gpus
from tailserve.frontdoor.render import BALANCE, FrontDoorPolicy
from tailserve.router.config import parse_model_balance
from tailserve.router.lanes import DEFAULT_THRESHOLD_MS
from tailserve.router.route_command import add_trace_arguments, trace_flags
from tailserve.settings import LOG_LEVELS

if TYPE_CHECKING:
    from tailserve.assembly.stack import FleetConfig

EXAMPLES = Path("var/repository")


# Redis security flags `tailserve up` passes on to each worker as they are (files, no secrets).
REDIS_FILE_FLAGS = (
    ("--redis-password-file", "redis_password_file", "a file whose first line is Redis's password"),
    ("--redis-tls-ca-file", "redis_tls_ca_file", "CA certificate for a rediss:// URL"),
    ("--redis-tls-cert-file", "redis_tls_cert_file", "client certificate for a rediss:// URL"),
    ("--redis-tls-key-file", "redis_tls_key_file", "client key for a rediss:// URL"),
)


def add_parser(commands: Any) -> None:
    up = commands.add_parser(
        "up",
        help="the whole stack on one machine: front door, workers, and a supervisor over them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--repository", help=f"model repository (default: the examples, {EXAMPLES})")
    up.add_argument(
        "--host", default="127.0.0.1", help="the front door's address (127.0.0.1; 0.0.0.0: all)"
    )
    up.add_argument("--port", type=int, default=8080, help="the front door's port (8080)")
    up.add_argument(
        "--grpc-port", type=int, default=8081, help="the front door's gRPC port (8081; 0: none)"
    )
    up.add_argument(
        "--workers",
        type=int,
        help="worker processes (default: one per GPU, else one per core)",
    )
    up.add_argument(
        "--gpus",
        default="auto",
        help="GPUs to spread the workers over, one each (auto: those visible; none; a count; "
        "ids: 0,2)",
    )
    up.add_argument(
        "--redis-url",
        help="Redis for shared state (default: none, in memory); redis+cluster://HOST:PORT: a "
        "node of a Redis Cluster",
    )
    up.add_argument(
        "--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster"
    )
    for flag, dest, text in REDIS_FILE_FLAGS:
        up.add_argument(flag, dest=dest, help=text)
    up.add_argument(
        "--jobs-concurrency", type=int, help="jobs each worker runs at once (4; 0: none)"
    )
    up.add_argument(
        "--jobs-visibility-timeout",
        dest="jobs_visibility_timeout_s",
        type=float,
        help="seconds before a job a dead worker held goes to another (30; with Redis)",
    )
    up.add_argument("--admin-token", help="bearer token the workers' admin routes require")
    up.add_argument(
        "--model-memory-mb",
        type=float,
        help="MiB each worker's models may hold together: the least wanted unload and load "
        "again on demand (0: no budget)",
    )
    up.add_argument(
        "--pinned-models", metavar="NAME,...", help="models that never unload for the budget"
    )
    up.add_argument(
        "--model-eviction",
        choices=("lru", "traffic"),
        help="which model unloads to make room: the least recently used (default) or the "
        "least recent traffic",
    )
    add_front_door_arguments(up)
    add_lane_arguments(up)
    add_trace_arguments(up)
    add_scaling_arguments(up)
    up.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        dest="drain_timeout_s",
        help="seconds SIGTERM waits for requests in flight (30)",
    )
    up.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the least severe level logged (info)",
    )
    up.set_defaults(handler=handle)


def add_front_door_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FrontDoorPolicy()
    parser.add_argument(
        "--balance",
        choices=tuple(BALANCE),
        default=defaults.balance,
        help="how a worker is chosen (p2c: power of two choices)",
    )
    parser.add_argument(
        "--model-balance",
        action="append",
        default=[],
        metavar="MODEL=POLICY",
        help="another policy for one model (repeat)",
    )
    parser.add_argument(
        "--max-conn",
        type=int,
        default=defaults.max_conn,
        help=f"requests in flight per worker and model; more wait in a queue ({defaults.max_conn})",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        help=f"requests queued per worker and model before a 503 ({defaults.max_queue})",
    )
    parser.add_argument(
        "--queue-share",
        type=float,
        default=defaults.queue_share,
        help="the longest wait in the queue, as a share of the model's SLO "
        f"({defaults.queue_share})",
    )


def add_scaling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--min-workers",
        type=int,
        help="autoscale: the fewest serving workers (with --max-workers; default: --workers)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        help="autoscale: the most serving workers (a worker beyond the cores adds no capacity)",
    )
    parser.add_argument(
        "--warm-pool",
        type=int,
        default=0,
        help="autoscale: workers kept loaded and warm outside the rotation, promoted in "
        "milliseconds (0)",
    )
    parser.add_argument(
        "--scale-down-after",
        type=float,
        default=ScalingConfig().downscale_delay_s,
        metavar="SECONDS",
        help="autoscale: a worker is removed after this long in which fewer would have done "
        f"({ScalingConfig().downscale_delay_s:g})",
    )
    parser.add_argument(
        "--target-in-flight",
        type=float,
        default=ScalingConfig().target_in_flight,
        help="autoscale: requests in flight one worker should carry "
        f"({ScalingConfig().target_in_flight:g})",
    )


def scaling_plan(
    args: argparse.Namespace, repository: str, workers: int
) -> tuple[int, ScalingPlan | None]:
    """The workers to start with (``workers`` for a fixed count), and the autoscaler's plan
    (None: a fixed count)."""
    if args.min_workers is None and args.max_workers is None:
        if args.warm_pool:
            raise ConfigError("--warm-pool needs --max-workers (it is part of autoscaling)")
        return workers, None
    lowest = args.min_workers if args.min_workers is not None else 1
    highest = args.max_workers if args.max_workers is not None else max(lowest, workers)
    if args.warm_pool < 0:
        raise ConfigError(f"--warm-pool must be at least 0, not {args.warm_pool}")
    slos = repository_models(Path(repository)).values()
    scaling = ScalingConfig(
        min_workers=lowest,
        max_workers=highest,
        slo_s=min(slos, default=1000.0) / 1e3,
        target_in_flight=args.target_in_flight,
        downscale_delay_s=args.scale_down_after,
        cores=usable_cores(),
    )
    return lowest, ScalingPlan(scaling=scaling, warm_pool=args.warm_pool)


def add_lane_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hedge-lane-ms",
        type=float,
        default=DEFAULT_THRESHOLD_MS,
        help="models predicted slower than this for one row take the hedging "
        f"lane ({DEFAULT_THRESHOLD_MS:g}; 0: by name only)",
    )
    parser.add_argument(
        "--hedge-model",
        action="append",
        default=[],
        metavar="MODEL",
        help="a model that always takes the hedging lane (repeat)",
    )


def usable_cores() -> int:
    """The cores this process may run on (a container's CPU set, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def handle(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from tailserve.assembly.stack import Supervisor
    from tailserve.process.loops import run

    run(Supervisor(fleet_config(args, os.environ)).run())
    return 0


def fleet_config(args: argparse.Namespace, env: Mapping[str, str]) -> FleetConfig:
    """The supervisor's settings from the flags (and the environment the workers will read)."""
    from tailserve.assembly.stack import FleetConfig

    repository = args.repository or str(example_repository(EXAMPLES))
    if not Path(repository).is_dir():
        raise ConfigError(f"no model repository at {repository}")
    # A token set as TAILSERVE_ADMIN_TOKEN reaches the workers; the router needs it as well.
    admin_token = args.admin_token or env.get("TAILSERVE_ADMIN_TOKEN") or None
    devices = gpus(args.gpus, env)
    default = len(devices) or usable_cores()
    workers, plan = scaling_plan(
        args, repository, default if args.workers is None else args.workers
    )
    return FleetConfig(
        repository=repository,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        workers=workers,
        scaling=plan,
        gpus=devices,
        policy=FrontDoorPolicy(
            balance=args.balance,
            model_balance=parse_model_balance(args.model_balance),
            max_conn=args.max_conn,
            max_queue=args.max_queue,
            queue_share=args.queue_share,
        ),
        admin_token=admin_token,
        redis_password=without_password(args.redis_url)[1] if args.redis_url else None,
        drain_timeout_s=args.drain_timeout_s,
        worker_args=tuple(worker_args(args)),
        jobs_in_process=args.redis_url is None,
        log_level=args.log_level,
        hedge_lane_ms=args.hedge_lane_ms,
        hedge_models=tuple(args.hedge_model),
        lane_args=tuple(trace_flags(args)),
    )


def gpus(value: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs ``--gpus`` names (``auto``: those visible here, detected)."""
    named = parse_gpus(value, env)
    return detect_gpus() if named is None else named


def worker_args(args: argparse.Namespace) -> list[str]:
    """The flags of ours that each ``tailserve serve`` takes as they are."""
    out: list[str] = []
    if args.redis_url is not None:
        parse_url(args.redis_url, cluster=args.redis_cluster)  # a bad one stops us, not them
        # Its password goes by the environment (FleetConfig.redis_password), not where `ps`
        # shows it.
        out += ["--redis-url", without_password(args.redis_url)[0]]
    for flag, dest, _ in REDIS_FILE_FLAGS:
        if getattr(args, dest, None):
            out += [flag, getattr(args, dest)]
    if args.redis_cluster:
        out.append("--redis-cluster")
    if args.jobs_concurrency is not None:
        out += ["--jobs-concurrency", str(args.jobs_concurrency)]
    if args.jobs_visibility_timeout_s is not None:
        out += ["--jobs-visibility-timeout", str(args.jobs_visibility_timeout_s)]
    if args.model_memory_mb is not None:
        if args.model_memory_mb < 0:
            raise ConfigError(f"--model-memory-mb must be at least 0, not {args.model_memory_mb}")
        out += ["--model-memory-mb", str(args.model_memory_mb)]
    if args.pinned_models:
        out += ["--pinned-models", args.pinned_models]
    if args.model_eviction:
        out += ["--model-eviction", args.model_eviction]
    return out + trace_flags(args)


def example_repository(directory: Path) -> Path:
    """The example repository in ``directory``, written there first unless it already is."""
    if not (directory / "churn" / "model.yaml").exists():
        from tailserve.examples import write_examples

        print(f"tailserve up: writing the example repository to {directory} ...", file=sys.stderr)
        write_examples(directory)
    return directory
