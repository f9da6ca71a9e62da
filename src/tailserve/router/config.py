"""The router's settings: where it listens, where its backends come from, and its policies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tailserve.errors import ConfigError
from tailserve.router.balancing import BALANCERS


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    # Loopback: the lane runs behind the front door.
    host: str = "127.0.0.1"
    port: int = 8080
    # The Open Inference Protocol over gRPC, sent on to the workers over HTTP (0: none).
    grpc_port: int = 0
    # Membership: fixed URLs, a file of URLs (one a line, watched), and/or a DNS name
    # (host:port) whose addresses are the backends (a Kubernetes headless Service).
    backends: tuple[str, ...] = ()
    backends_file: str | None = None
    backends_dns: str | None = None
    dns_interval_s: float = 5.0
    file_interval_s: float = 1.0
    # OpenTelemetry traces (router/route_spans.py): sent to this OTLP/HTTP endpoint (None: no
    # tracing), for this share of the requests that come with no sampled parent.
    otel_endpoint: str | None = None
    otel_sample: float = 0.01
    # Replica choice: the default policy, and per-model overrides (model -> policy).
    balance: str = "p2c"
    model_balance: dict[str, str] = field(default_factory=dict)
    epsilon: float = 0.25
    # Hedged requests (inference only): after the model's recent p95, within the budget.
    hedge: bool = True
    hedge_ratio: float = 0.05
    hedge_quantile: float = 0.95
    hedge_min_delay_s: float = 0.001
    # Replies of a model (and cost class) seen before its p95 is trusted to hedge on.
    hedge_min_samples: int = 50
    # A request that fails to connect (or whose connection dies before a reply) is retried
    # once on another replica, within this share of requests.
    retry_ratio: float = 0.1
    # Per-backend in-flight limit: above it a backend takes nothing more; when all are at it
    # the router sheds at once (503 + Retry-After).
    max_in_flight: int = 64
    # Connections kept to each backend (at most).
    max_connections: int = 64
    # A request with no deadline of its own gets this long upstream.
    request_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    # Outlier ejection: errors or timeouts in a row that eject a backend, and the first
    # ejection's length (doubling with each one after).
    eject_after_failures: int = 5
    eject_base_s: float = 5.0
    # ... and of a slow one's (a latency outlier, or limping): it tends to stay slow a while.
    eject_slow_base_s: float = 30.0
    # A backend whose EWMA latency is this many times the others' median (and above 50 ms)
    # is ejected too; 0 turns latency ejection off.
    eject_latency_factor: float = 3.0
    # A backend this share of whose recent requests lost to hedges (at least five, and three
    # times the others' median share) is ejected too: it stalls now and then. 0 turns it off.
    eject_overtaken_share: float = 0.02
    # The bearer token of the workers' admin routes (the router reads each one's model index).
    admin_token: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    # A client's idle kept-alive connection closes after this long (longer than the
    # worker's: a load balancer in front keeps connections open a minute); a request whose
    # head is not whole this long after its first byte, or whose body stops coming for this
    # long, gets a 408 and the connection closes.
    keep_alive_s: float = 75.0
    read_timeout_s: float = 30.0
    # Fraction of routing decisions logged (logger tailserve.router.decisions, INFO).
    decision_sample: float = 0.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (self.balance, *self.model_balance.values()):
            if name not in BALANCERS:
                raise ConfigError(
                    f"unknown balancing policy {name!r}: expected one of {', '.join(BALANCERS)}"
                )
        for url in self.backends:
            parse_backend(url)
        if self.keep_alive_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError("keep_alive_s and read_timeout_s must be above 0")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be at least 1, not {self.max_in_flight}")
        if not 0.0 <= self.hedge_ratio <= 1.0 or not 0.0 <= self.retry_ratio <= 1.0:
            raise ConfigError("hedge_ratio and retry_ratio must be in [0, 1]")
        if not 0.0 <= self.eject_overtaken_share <= 1.0:
            raise ConfigError(
                f"eject_overtaken_share must be in [0, 1], not {self.eject_overtaken_share}"
            )
        if self.backends_dns is not None:
            parse_host_port(self.backends_dns, "--backends-dns")

    def policy_of(self, model: str) -> str:
        return self.model_balance.get(model, self.balance)

    def replace(self, **changes: Any) -> RouterConfig:
        return dataclasses.replace(self, **changes)


def parse_backend(url: str) -> tuple[str, int]:
    """``http://host:port`` (or ``host:port``) → (host, port)."""
    text = url if "://" in url else f"http://{url}"
    try:
        parts = urlsplit(text)
        port = parts.port  # (a port that is no number, or past 65535, raises here)
    except ValueError as exc:
        raise ConfigError(f"backend {url!r} is not http://HOST:PORT ({exc})") from None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ConfigError(f"backend {url!r} is not http://HOST:PORT")
    if parts.path not in ("", "/"):
        raise ConfigError(f"backend {url!r} has a path; give http://HOST:PORT only")
    return parts.hostname, port


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{what} {text!r} is not HOST:PORT")
    return host, int(port)


def backend_url(host: str, port: int) -> str:
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{port}"


def parse_model_balance(items: list[str]) -> dict[str, str]:
    """``MODEL=POLICY`` items (from --model-balance) → a dict."""
    out = {}
    for item in items:
        model, sep, policy = item.partition("=")
        if not sep or not model or not policy:
            raise ConfigError(f"--model-balance {item!r} is not MODEL=POLICY")
        out[model] = policy
    return out
