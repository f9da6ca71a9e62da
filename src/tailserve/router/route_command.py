"""tailserve route: the router in front of running workers.

tailserve route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 [--port 8080]
tailserve route --backends-file workers.txt     # one URL a line, re-read when it changes
tailserve route --backends-dns workers.default.svc:8000   # every address of a name
tailserve route ... --otel-endpoint http://collector:4318   # traces (docs/observability.md)
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from tailserve.errors import ConfigError, shown
from tailserve.observability.tracing import ENDPOINT_ENV
from tailserve.router.balancing import BALANCERS
from tailserve.router.config import RouterConfig, parse_model_balance
from tailserve.settings import LOG_LEVELS

# The sample ratio's variable, as `tailserve serve` reads it (settings.py).
SAMPLE_ENV = "TAILSERVE_OTEL_SAMPLE"


def add_parser(commands: Any) -> None:
    route = commands.add_parser(
        "route",
        help="the router: spreads requests over workers (affinity, p2c, hedging, health)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    route.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's URL (repeat for each)",
    )
    route.add_argument("--backends-file", metavar="FILE", help="file of worker URLs, watched")
    route.add_argument(
        "--backends-dns",
        metavar="HOST:PORT",
        help="a name whose every address is a worker (re-resolved)",
    )
    route.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: behind the front door)",
    )
    route.add_argument("--port", type=int, default=8080, help="port to listen on (8080)")
    route.add_argument(
        "--grpc-port", type=int, default=8081, help="gRPC port, sent on over HTTP (8081; 0: none)"
    )
    add_policy_arguments(route)
    add_trace_arguments(route)
    route.add_argument("--admin-token", help="the workers' admin token (to read model indexes)")
    route.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the least severe level logged (info)",
    )
    route.set_defaults(handler=handle)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing policy's options, the same for `route` and `up`."""
    parser.add_argument(
        "--balance", choices=BALANCERS, default="p2c", help="how a replica is chosen (p2c)"
    )
    parser.add_argument(
        "--model-balance",
        action="append",
        default=[],
        metavar="MODEL=POLICY",
        help="another policy for one model (repeat)",
    )
    parser.add_argument("--no-hedge", action="store_true", help="never hedge requests")
    parser.add_argument(
        "--hedge-ratio",
        type=float,
        default=0.05,
        help="most extra copies hedging may send, per request (0.05)",
    )
    parser.add_argument(
        "--max-in-flight", type=int, default=64, help="requests in flight a worker may hold (64)"
    )
    parser.add_argument(
        "--eject-latency-factor",
        type=float,
        default=3.0,
        help="eject a worker this many times slower than the rest (3; 0: never)",
    )
    parser.add_argument(
        "--eject-overtaken-share",
        type=float,
        default=0.02,
        help="eject a worker this share of whose requests keep losing to hedges (0.02; 0: never)",
    )
    parser.add_argument(
        "--decision-sample",
        type=float,
        default=0.0,
        help="fraction of routing decisions to log (0)",
    )
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=75.0,
        dest="keep_alive_s",
        help="close a client's connection idle this long (75 s)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        dest="read_timeout_s",
        help="408 to a request whose head or body stops coming this long (30 s)",
    )


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """OpenTelemetry's options, the same for `route` and `up` (and `serve`'s names)."""
    parser.add_argument(
        "--otel-endpoint",
        help="send OpenTelemetry traces over OTLP/HTTP here "
        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--otel-sample",
        type=float,
        help="share of requests traced when no sampled traceparent comes with them (0.01)",
    )


def trace_flags(args: argparse.Namespace) -> list[str]:
    """The trace options given, as flags for another tailserve process (`up`'s workers and
    lane; without them each reads the environment it inherits)."""
    out = []
    if args.otel_endpoint:
        out += ["--otel-endpoint", args.otel_endpoint]
    if args.otel_sample is not None:
        if not 0.0 <= args.otel_sample <= 1.0:
            raise ConfigError(f"--otel-sample must be between 0 and 1, not {args.otel_sample}")
        out += ["--otel-sample", repr(args.otel_sample)]
    return out


def config_from(args: argparse.Namespace, **extra: Any) -> RouterConfig:
    return RouterConfig(
        balance=args.balance,
        model_balance=parse_model_balance(args.model_balance),
        hedge=not args.no_hedge,
        hedge_ratio=args.hedge_ratio,
        max_in_flight=args.max_in_flight,
        eject_latency_factor=args.eject_latency_factor,
        eject_overtaken_share=args.eject_overtaken_share,
        admin_token=getattr(args, "admin_token", None),
        decision_sample=args.decision_sample,
        keep_alive_s=args.keep_alive_s,
        read_timeout_s=args.read_timeout_s,
        **extra,
    )


def handle(args: argparse.Namespace) -> int:
    if not (args.backend or args.backends_file or args.backends_dns):
        raise ConfigError("no backends: give --backend URL, --backends-file or --backends-dns")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sample = args.otel_sample
    if sample is None:
        given = os.environ.get(SAMPLE_ENV, "0.01")
        try:
            sample = float(given)
        except ValueError:
            raise ConfigError(f"{SAMPLE_ENV} must be a number, not {shown(given)}") from None
    config = config_from(
        args,
        otel_endpoint=args.otel_endpoint or os.environ.get(ENDPOINT_ENV) or None,
        otel_sample=sample,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        backends=tuple(args.backend),
        backends_file=args.backends_file,
        backends_dns=args.backends_dns,
    )
    from tailserve.process.loops import run
    from tailserve.router.proxy import Router

    run(Router(config).serve())
    return 0
