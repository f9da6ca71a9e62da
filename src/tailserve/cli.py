"""The ``tailserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tailserve.errors import TailserveError
from tailserve.settings import load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except TailserveError as exc:
        print(f"tailserve: {exc.message}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailserve", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="one worker: load, warm and serve a repository")
    serve.add_argument("--repository", help="model repository folder")
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--http-port", type=int, help="HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 8001)")
    serve.add_argument("--redis-url", help="Redis for shared state (default: none, in memory)")
    serve.add_argument(
        "--redis-cluster",
        action="store_true",
        default=None,
        help="--redis-url names a node of a Redis Cluster",
    )
    serve.add_argument(
        "--cache-l2-budget-ms",
        type=float,
        help="the most a cache lookup waits for Redis before it counts as a miss (5)",
    )
    serve.add_argument("--worker-id", help="name in cache lineage (default host:pid)")
    serve.add_argument("--admin-token", help="bearer token the admin routes require")
    serve.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413")
    serve.add_argument(
        "--drain-timeout",
        type=float,
        dest="drain_timeout_s",
        help="seconds SIGTERM waits for requests in flight (default 30)",
    )
    serve.add_argument(
        "--strict-readiness",
        action="store_true",
        default=None,
        help="unready while any model failed to load",
    )
    serve.add_argument("--log-level", help="debug, info, warning, error")
    serve.add_argument("--access-log", action="store_true", default=None)
    serve.add_argument("--trace-file", help="log sampled requests here, for bench to replay")
    serve.add_argument("--trace-sample", type=float, help="fraction of requests logged (1.0)")
    serve.add_argument("--config", type=Path, help="YAML file of settings")
    serve.set_defaults(handler=_serve)

    examples = commands.add_parser("examples", help="write the example model repository")
    examples.add_argument("directory", type=Path)
    examples.add_argument(
        "--sklearn",
        action="store_true",
        help="also write churn_sklearn: the pipeline pickled with joblib (trust: true)",
    )
    examples.set_defaults(handler=_examples)

    from tailserve.loadgen import command as bench

    bench.add_parser(commands)
    return parser  # fmt: skip


def _serve(args: argparse.Namespace) -> int:
    overrides = {
        key: getattr(args, key)
        for key in (
            "repository", "host", "http_port", "grpc_port", "redis_url", "redis_cluster",
            "cache_l2_budget_ms", "worker_id", "admin_token",
            "max_body_bytes", "drain_timeout_s", "strict_readiness", "log_level", "access_log",
            "trace_file", "trace_sample",
        )
    }  # fmt: skip
    settings = load_settings(config_file=args.config, env=os.environ, overrides=overrides)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from tailserve.loops import run
    from tailserve.server import Worker

    worker = Worker(settings)
    run(worker.serve())
    return 0


def _examples(args: argparse.Namespace) -> int:
    from tailserve.examples import write_examples

    names = write_examples(args.directory, sklearn=args.sklearn)
    print(f"wrote {', '.join(names)} to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
