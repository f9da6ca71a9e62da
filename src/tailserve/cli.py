"""The tailserve command line."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tailserve import __version__
from tailserve.errors import TailserveError
from tailserve.settings import LOG_LEVELS, load_settings

DESCRIPTION = "tailserve: a low-latency machine-learning serving system."
EPILOG = (
    "Start with 'tailserve up': it serves the example models on http://127.0.0.1:8080. "
    "'tailserve COMMAND --help' tells more about each command."
)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["serve"]:
        # Before anything else is imported: the process starts again (see the module).
        from tailserve.assembly.hugepages import restart_with_huge_pages

        restart_with_huge_pages()  # returns where it need not
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except TailserveError as exc:
        print(f"tailserve: {exc.message}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailserve", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"tailserve {__version__}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    _add_serve_command(commands)
    _add_examples_command(commands)
    from tailserve.loadgen import bench_command as bench

    bench.add_parser(commands)
    from tailserve.router import route_command as route

    route.add_parser(commands)
    from tailserve.assembly import up as fleet

    fleet.add_parser(commands)
    _add_cache_commands(commands)
    _add_optimize_command(commands)
    return parser


def _add_serve_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = _add_command(commands, "serve", "one worker: load, warm and serve a repository")
    serve.add_argument("--repository", help="model repository folder")
    serve.add_argument(
        "--host",
        help="address to listen on (default 127.0.0.1; beyond loopback, such as 0.0.0.0, the "
        "admin routes need --admin-token)",
    )
    serve.add_argument("--http-port", type=int, help="HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 8001; 0: no gRPC)")
    _redis_options(serve)
    _worker_options(serve)
    _observing_options(serve)
    _work_options(serve)
    serve.add_argument("--config", type=Path, help="YAML file of settings")
    serve.set_defaults(handler=_serve)


def _redis_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--redis-url",
        help="Redis for shared state (default: none, in memory); redis+cluster://HOST:PORT: a "
        "node of a Redis Cluster",
    )
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
    serve.add_argument(
        "--redis-password-file",
        help="a file whose first line is Redis's password (or TAILSERVE_REDIS_PASSWORD; either "
        "keeps it out of the command line)",
    )
    serve.add_argument("--redis-tls-ca-file", help="CA certificate for a rediss:// URL")
    serve.add_argument("--redis-tls-cert-file", help="client certificate for a rediss:// URL")
    serve.add_argument("--redis-tls-key-file", help="client key for a rediss:// URL")
    serve.add_argument(
        "--redis-client",
        choices=("lean", "redis-py"),
        help="the cache's MGET/SET path on a single Redis (lean)",
    )


def _worker_options(serve: argparse.ArgumentParser) -> None:
    """Who the worker is, who may administer it, what it accepts and how it stops."""
    serve.add_argument("--worker-id", help="name in cache lineage (default host:pid)")
    serve.add_argument(
        "--admin-token",
        help="bearer token the admin routes require (without one they are open on loopback "
        "and closed beyond it)",
    )
    serve.add_argument("--max-body-bytes", type=int, help="larger request bodies get 413")
    serve.add_argument(
        "--reply-memo-mb",
        type=float,
        help="MiB of encoded L1-hit replies kept for repeated requests (64; 0: off)",
    )
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
        help="unready while any model failed to load (one left out for want of --redis-url "
        "did not fail)",
    )


def _observing_options(serve: argparse.ArgumentParser) -> None:
    """Logs, traces and the event loop's own tuning."""
    serve.add_argument(
        "--log-level", choices=LOG_LEVELS, help="the least severe level logged (info)"
    )
    serve.add_argument(
        "--access-log", action="store_true", default=None, help="log a line for each request"
    )
    serve.add_argument("--trace-file", help="log sampled requests here, for bench to replay")
    serve.add_argument("--trace-sample", type=float, help="fraction of requests logged (1.0)")
    serve.add_argument(
        "--otel-endpoint",
        help="send OpenTelemetry traces over OTLP/HTTP here "
        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    serve.add_argument(
        "--otel-sample",
        type=float,
        help="share of requests traced when no sampled traceparent comes with them (0.01)",
    )
    serve.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        help="how long the event loop may keep the GIL from a model's thread (0.5; 0: Python's)",
    )
    serve.add_argument(
        "--gc-full-interval-s",
        type=float,
        help="seconds between full garbage collections, run by the event loop (30; 0: "
        "Python's own schedule)",
    )
    serve.add_argument(
        "--fault-slow-fraction",
        type=float,
        help="TEST ONLY: this fraction of inference requests is made slow (0)",
    )
    serve.add_argument(
        "--fault-slow-factor", type=float, help="TEST ONLY: how many times slower (20)"
    )


def _work_options(serve: argparse.ArgumentParser) -> None:
    """Jobs and the models' memory budget."""
    serve.add_argument(
        "--jobs-concurrency",
        type=int,
        help="jobs this worker runs at once (4; 0: it runs none, but accepts them)",
    )
    serve.add_argument(
        "--jobs-visibility-timeout",
        dest="jobs_visibility_timeout_s",
        type=float,
        help="seconds a job held by a worker that stopped renewing it waits for another (30)",
    )
    serve.add_argument(
        "--model-memory-mb",
        type=float,
        help="MiB the models may hold together: the least wanted unload and load again when "
        "a request needs them (0: no budget, all load at start)",
    )
    serve.add_argument(
        "--model-eviction",
        choices=("lru", "traffic"),
        help="which model unloads to make room: the least recently used (default) or the "
        "least recent traffic",
    )
    serve.add_argument(
        "--pinned-models",
        metavar="NAME,...",
        help="models that never unload for the memory budget",
    )


def _add_examples_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    examples = _add_command(commands, "examples", "write the example model repository")
    examples.add_argument("directory", type=Path, help="the folder to write it to")
    examples.add_argument(
        "--torch",
        action="store_true",
        help="also write churn_torch: a TorchScript MLP with an INT8 variant (the torch extra)",
    )
    examples.add_argument(
        "--sklearn",
        action="store_true",
        help="also write churn_sklearn: the pipeline pickled with joblib (trust: true)",
    )
    examples.add_argument(
        "--redis-url", help="also load the ranker's synthetic features into this Redis"
    )
    examples.add_argument(
        "--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster"
    )
    examples.add_argument(
        "--features-only",
        action="store_true",
        help="write no models: only load the ranker's features of DIRECTORY into --redis-url",
    )
    examples.set_defaults(handler=_examples)


def _add_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str
) -> argparse.ArgumentParser:
    # The summary is the line in the list of commands and the description of COMMAND --help.
    return commands.add_parser(name, help=summary, description=summary)


def _serve(args: argparse.Namespace) -> int:
    overrides = {
        key: getattr(args, key)
        for key in (
            "repository",
            "host",
            "http_port",
            "grpc_port",
            "redis_url",
            "redis_cluster",
            "cache_l2_budget_ms",
            "redis_client",
            "redis_password_file",
            "redis_tls_ca_file",
            "redis_tls_cert_file",
            "redis_tls_key_file",
            "reply_memo_mb",
            "worker_id",
            "admin_token",
            "max_body_bytes",
            "drain_timeout_s",
            "strict_readiness",
            "log_level",
            "access_log",
            "trace_file",
            "trace_sample",
            "otel_endpoint",
            "otel_sample",
            "fault_slow_fraction",
            "fault_slow_factor",
            "gil_switch_interval_ms",
            "gc_full_interval_s",
            "jobs_concurrency",
            "jobs_visibility_timeout_s",
            "model_memory_mb",
            "pinned_models",
            "model_eviction",
        )
    }
    if overrides["otel_endpoint"] is None:
        overrides["otel_endpoint"] = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    settings = load_settings(config_file=args.config, env=os.environ, overrides=overrides)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from tailserve.assembly.worker import Worker
    from tailserve.process.loops import run

    worker = Worker(settings)
    run(worker.serve())
    return 0


def _examples(args: argparse.Namespace) -> int:
    from tailserve.examples import write_examples

    if args.features_only:
        if args.redis_url is None:
            print("--features-only needs --redis-url", file=sys.stderr)
            return 2
        if not (args.directory / "ranker" / "model.yaml").is_file():
            missing = f"{args.directory} holds no ranker: run `tailserve examples` first"
            print(missing, file=sys.stderr)
            return 2
    else:
        if args.torch and importlib.util.find_spec("torch") is None:
            print("--torch needs torch: pip install 'tailserve[torch]'", file=sys.stderr)
            return 2
        names = write_examples(args.directory, sklearn=args.sklearn, torch=args.torch)
        print(f"wrote {', '.join(names)} to {args.directory}")
    if args.redis_url is not None:
        from tailserve.cache.redis import redacted
        from tailserve.examples import load_features

        counts = load_features(
            args.directory / "ranker", args.redis_url, cluster=args.redis_cluster
        )
        loaded = ", ".join(f"{count:,} {entity}s" for entity, count in counts.items())
        print(f"loaded the ranker's features into {redacted(args.redis_url)}: {loaded}")
    return 0


def _add_cache_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    precompute = _add_command(
        commands,
        "precompute",
        "batch-score known inputs (JSON lines of records) into the result cache in Redis",
    )
    precompute.add_argument("--repository", type=Path, required=True, help="model repository")
    precompute.add_argument("--model", required=True, help="the model to score with")
    precompute.add_argument(
        "--input",
        type=Path,
        required=True,
        metavar="FILE.jsonl",
        help='one request a line, as a record: {"field": value, ...}',
    )
    precompute.add_argument("--redis-url", required=True, help="the workers' Redis")
    precompute.add_argument(
        "--redis-cluster", action="store_true", help="--redis-url names a node of a Redis Cluster"
    )
    precompute.add_argument("--batch-size", type=int, default=256, help="lines a batch (256)")
    precompute.add_argument(
        "--ttl-s", type=float, help="how long results stay fresh (default: the model's L2 TTL)"
    )
    precompute.add_argument(
        "--checkpoint", type=Path, help="file of lines done: a rerun with it resumes after them"
    )
    precompute.add_argument(
        "--version", type=int, help="model version (default: the newest that serves)"
    )
    precompute.add_argument(
        "--skip-bad",
        action="store_true",
        help="count bad lines and go on (default: stop at the first, naming it)",
    )
    precompute.add_argument(
        "--parameters",
        metavar="JSON",
        help="request parameters of every line, as a JSON object (for cache.key.parameters)",
    )
    precompute.add_argument("--quiet", action="store_true", help="no progress line")
    precompute.set_defaults(handler=_precompute)

    warm = _add_command(
        commands, "warm", "replay a trace's most frequent requests to fill a worker's caches"
    )
    warm.add_argument("trace", type=Path, metavar="TRACE.jsonl", help="a worker's --trace-file")
    warm.add_argument("--target", required=True, help="the worker (or router) URL")
    warm.add_argument("--top", type=int, default=1000, help="distinct requests to send (1000)")
    warm.add_argument("--concurrency", type=int, default=8, help="requests at once (8)")
    warm.add_argument(
        "--timeout", type=float, default=30.0, dest="timeout_s", help="seconds a request (30)"
    )
    warm.set_defaults(handler=_warm)


def _precompute(args: argparse.Namespace) -> int:
    import orjson

    from tailserve.errors import ConfigError
    from tailserve.jobs.precompute import Job, precompute, summary
    from tailserve.process.loops import run

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    parameters = {}
    if args.parameters is not None:
        try:
            parameters = orjson.loads(args.parameters)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"--parameters is not valid JSON: {exc}") from None
        if not isinstance(parameters, dict):
            raise ConfigError('--parameters must be a JSON object: {"name": value, ...}')
    job = Job(
        repository=args.repository,
        model=args.model,
        input=args.input,
        redis_url=args.redis_url,
        cluster=args.redis_cluster,
        batch_size=args.batch_size,
        ttl_s=args.ttl_s,
        checkpoint=args.checkpoint,
        version=args.version,
        skip_bad=args.skip_bad,
        parameters=parameters,
    )
    try:
        report = run(precompute(job, progress=None if args.quiet else sys.stderr))
    except KeyboardInterrupt:
        hint = f": rerun with --checkpoint {args.checkpoint} to resume" if args.checkpoint else ""
        print(f"\ntailserve: precompute interrupted{hint}", file=sys.stderr)
        return 130
    for reason in report.bad_lines:
        print(f"tailserve: passed over {reason}", file=sys.stderr)
    print(summary(report))
    if report.stopped_at is not None:
        if args.checkpoint:
            print(
                f"tailserve: rerun with --checkpoint {args.checkpoint} to resume", file=sys.stderr
            )
        return 130
    return 0


def _warm(args: argparse.Namespace) -> int:
    from tailserve.jobs.warm import summary, warm
    from tailserve.process.loops import run

    report = run(
        warm(
            args.trace,
            args.target,
            top=args.top,
            concurrency=args.concurrency,
            timeout_s=args.timeout_s,
        )
    )
    print(summary(report))
    for sample in report.error_samples:
        print(f"tailserve: warm: {sample}", file=sys.stderr)
    return 1 if report.errors else 0


def _add_optimize_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    optimize = _add_command(
        commands,
        "optimize",
        "write graph-optimised and INT8 variants of a model, measure them against it (latency, "
        "size, accuracy) and keep the useful ones in its model.yaml",
    )
    optimize.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="the model's folder")
    optimize.add_argument("--version", type=int, help="the version folder (default: the newest)")
    optimize.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE.npz",
        help="inputs to calibrate static INT8 with: arrays named like the inputs, rows first "
        "(default: synthetic draws from the input specs)",
    )
    optimize.add_argument(
        "--held-out",
        type=Path,
        metavar="FILE.npz",
        help="inputs to measure accuracy on, like --calibration, optionally with a 'labels' "
        "array of 0 or 1 (default: synthetic draws, another seed)",
    )
    optimize.add_argument(
        "--batch-sizes",
        metavar="1,8,64",
        help="batch sizes to time (default: the model's warm-up sizes, or 1,8,64)",
    )
    optimize.add_argument(
        "--metric",
        choices=("auc", "accuracy", "max_abs_error"),
        help="how accuracy is measured (default: auc for one probability a row, else "
        "max_abs_error)",
    )
    optimize.add_argument(
        "--repeat", type=int, default=20, help="timed runs a batch size and variant (20)"
    )
    optimize.add_argument(
        "--no-write-config",
        dest="write_config",
        action="store_false",
        help="leave model.yaml as it is (default: rewrite its variants block)",
    )
    optimize.add_argument(
        "--variants",
        default="graph,dynamic,static",
        metavar="graph,dynamic,static",
        help="what to make: graph-optimised, dynamic INT8, static INT8 (all three)",
    )
    optimize.add_argument(
        "--keep",
        metavar="NAME,...",
        help="the variants model.yaml keeps (default: fp32 and each at least 1.1 times as "
        "fast at some batch size; see docs/optimize.md)",
    )
    optimize.set_defaults(handler=_optimize)


def _optimize(args: argparse.Namespace) -> int:
    from tailserve.errors import ConfigError
    from tailserve.optimize import Options, optimize, report_path, summary

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())

    try:
        sizes = names(args.batch_sizes)
        batch_sizes = None if sizes is None else tuple(int(size) for size in sizes)
    except ValueError:
        raise ConfigError(
            f"--batch-sizes: {args.batch_sizes!r} is not a list like 1,8,64"
        ) from None
    options = Options(
        version=args.version,
        calibration=args.calibration,
        held_out=args.held_out,
        batch_sizes=batch_sizes,
        metric=args.metric,
        repeat=args.repeat,
        write_config=args.write_config,
        kinds=names(args.variants) or (),
        keep=names(args.keep),
    )
    outcome = optimize(args.model_dir, options, progress=lambda line: print(line, file=sys.stderr))
    print(summary(outcome))
    for warning in outcome.warnings:
        print(f"tailserve: {warning}", file=sys.stderr)
    print(f"report: {report_path(args.model_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
