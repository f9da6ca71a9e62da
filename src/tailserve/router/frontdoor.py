"""The front door's configuration: tailserve's routing policies written as an HAProxy config.

The front door is HAProxy (a C proxy: no Python parses a request on the hop). This module is
pure: it turns the fleet's members, its models and the policy into the text of a config, which
`fleet.haproxy` writes, checks and loads. The mapping:

- one backend a model (``m.<model>``), holding every worker, each checked with the model's own
  readiness route, so a model's requests go only to workers where it is ready (loaded);
- a model ready on no worker (a worker under a memory budget unloads models and loads them on
  demand) goes to the ``cold`` backend: every ready worker, chosen by a consistent hash of the
  model's name, so that one worker loads it, not each in turn; a refusal from there (the load
  would not fit the request's deadline) is not retried elsewhere, where it would start a load
  too;
- the balancing policy: ``p2c`` is ``balance random(2)``, ``round-robin`` is ``roundrobin``,
  ``least-loaded`` is ``leastconn``, ``affinity`` is a consistent hash with bounded load
  (``hash-balance-factor``) on the ``X-Affinity-Key`` header, else on the request's body;
- admission: at most ``max_conn`` requests in flight per worker and model, then a queue of at
  most ``max_queue`` a worker, waited in for at most a share of the model's SLO; a request that
  finds the queues full gets a 503 with ``Retry-After`` at once, one that waits out its time
  gets it then;
- outlier ejection: ``observe layer7`` marks a worker down after ``error_limit`` errors in a
  row, and its checks bring it back;
- retries: a request whose connection failed, or that got no reply or a 503 (a worker that is
  draining or not ready), is tried again on another worker (``retries``, ``redispatch``);
- the fleet's own routes (``/metrics``, ``/v2/fleet``, ``/dashboard``, cache invalidation,
  repository load and unload) go to the supervisor's admin lane, which fans them out over
  every worker;
- a job's submission through a backend of its own, a few at a time a worker (a burst of them
  waits there, apart from the online requests and not refused); jobs kept in the workers' memory (no
  Redis): a job's routes go to the worker named by the id's prefix (``use-server``), and the
  list of jobs to the admin lane, which asks them all;
- the slow models (`router.lanes`) through the hedging lane, the Python router, which hedges;
- gRPC over HTTP/2 to the workers' gRPC ports, spread the same way;
- HAProxy's own Prometheus exporter on a loopback port, for the admin lane to merge.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tailserve.errors import ConfigError

BALANCE = {
    "p2c": "random(2)",
    "round-robin": "roundrobin",
    "least-loaded": "leastconn",
    "affinity": "hash var(txn.affinity)",
}
AFFINITY_HEADER = "x-affinity-key"
REPLICA_HEADER = "x-tailserve-replica"
# The routes the supervisor answers itself (its admin lane), by path prefix or path.
ADMIN_PATHS = ("/metrics", "/v2/fleet", "/dashboard")
ADMIN_PREFIXES = ("/v2/cache/", "/v2/repository/", "/dashboard/")
JOBS_PATH = "/v2/jobs"
# The backend of the models ready on no worker, and its choice of worker: a hash of the model's
# name, the fourth field of /v2/models/NAME/... and /v1/models/NAME:predict.
COLD_BACKEND = "cold"
MODEL_HASH = "hash path,field(4,/),field(1,:)"
# What HAProxy may put in a backend's name and a path's ACL without quoting.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# Stamped on every request: when the front door received it, in µs since the epoch.
RECEIVED_HEADER = "x-frontdoor-received-us"
REFUSAL_HEADER = "x-refusal-reason"
# The front door's own refusals, as x-refusal-reason says them.
_REFUSALS = {503: "frontdoor_full", 504: "frontdoor_timeout"}
_ERRORS = {
    400: "the request is malformed",
    408: "the request did not arrive in time",
    500: "the front door failed to handle the request",
    502: "a worker gave an invalid answer",
    503: "no worker can take the request in time: every worker is busy and its queue full, "
    "or none is ready; retry later",
    504: "the worker did not answer in time",
}


@dataclass(frozen=True, slots=True)
class Member:
    """A worker as the front door sees it."""

    name: str
    host: str
    http_port: int
    grpc_port: int = 0
    # In rotation. A worker out of it (a warm standby, one draining) is checked as the others
    # but takes no request: weight 0, until the runtime API or a reload changes it.
    serving: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontDoorPolicy:
    balance: str = "p2c"
    model_balance: dict[str, str] = field(default_factory=dict)
    # Requests in flight a worker takes from one model's backend; beyond it they queue.
    max_conn: int = 16
    # Requests queued for one worker beyond which a model's backend answers 503 at once.
    max_queue: int = 48
    # The longest a request waits in the queue, as a share of its model's SLO (the rest is
    # the worker's to serve it in).
    queue_share: float = 0.5
    # Bounded load for affinity: no worker takes over this percentage of the mean load.
    hash_balance_factor: int = 125
    # Tries after the first (on another worker) for a failed connect, no reply or a 503.
    retries: int = 2
    # Errors in a row from one worker that mark it down until its checks pass again.
    error_limit: int = 10
    check_interval_ms: int = 1000
    # A worker that is down (starting, loading a model, ejected) is checked this often, so
    # that it takes requests soon after it is ready again.
    down_check_interval_ms: int = 200
    connect_timeout_ms: int = 1000
    # A request with no deadline of its own gets this long from its worker.
    request_timeout_s: float = 30.0
    keep_alive_s: float = 75.0
    read_timeout_s: float = 30.0
    # Job submissions a worker takes at once, and how long the rest may wait their turn.
    submit_conn: int = 4
    submit_queue_s: float = 30.0
    max_body_bytes: int = 64 * 1024 * 1024
    max_connections: int = 20000
    threads: int = 1

    def __post_init__(self) -> None:
        for name in (self.balance, *self.model_balance.values()):
            if name not in BALANCE:
                raise ConfigError(
                    f"unknown balancing policy {name!r}: expected one of {', '.join(BALANCE)}"
                )
        if self.max_conn < 1 or self.max_queue < 0:
            raise ConfigError("max_conn must be at least 1 and max_queue at least 0")
        if not 0.0 < self.queue_share <= 1.0:
            raise ConfigError(f"queue_share must be in (0, 1], not {self.queue_share}")
        if self.hash_balance_factor < 100:
            raise ConfigError("hash_balance_factor is a percentage of at least 100")

    def policy_of(self, model: str) -> str:
        return self.model_balance.get(model, self.balance)


@dataclass(frozen=True, slots=True, kw_only=True)
class Listen:
    """Where the front door listens, and the loopback ports it reaches the fleet's parts on."""

    host: str
    port: int
    grpc_port: int = 0
    admin_port: int = 0  # the supervisor's admin lane (0: none)
    stats_port: int = 0  # HAProxy's Prometheus exporter, loopback only (0: none)
    # Where each worker's state (up, down) is kept across a reload ("": nowhere; a reloaded
    # front door would then take every worker for down until its first checks pass).
    state_file: str = ""
    # The hedging lane (`tailserve route` on loopback; 0: none), which the slow models take.
    lane_port: int = 0
    drain_timeout_s: float = 30.0
    # Jobs live in each worker's memory, not in Redis (see the module's docstring).
    jobs_in_process: bool = False


def routable(model: str) -> bool:
    """Whether a model's name can be a backend of its own (else the default backend serves)."""
    return bool(_NAME.match(model))


def render(
    listen: Listen,
    members: list[Member],
    models: dict[str, float],
    policy: FrontDoorPolicy,
    slow: frozenset[str] = frozenset(),
) -> str:
    """The HAProxy config for ``members`` serving ``models`` (name -> SLO p99 in ms); the
    ``slow`` ones go through the hedging lane, where there is one."""
    named = {m: slo for m, slo in sorted(models.items()) if routable(m)}
    laned = slow & set(named) if listen.lane_port else frozenset()
    lines = [
        *_global(listen, policy),
        *_defaults(listen, policy),
        *_frontend(listen, named, policy, laned),
    ]
    for model, slo_ms in named.items():
        lines += _backend(
            f"m.{model}",
            members,
            policy.policy_of(model),
            policy,
            f"/v2/models/{model}/ready",
            queue_ms=slo_ms * policy.queue_share,
        )
    fallback_slo = max(named.values(), default=1000.0)
    lines += _backend(
        COLD_BACKEND,
        members,
        policy.balance,
        policy,
        "/v2/health/ready",
        queue_ms=fallback_slo * policy.queue_share,
        by_model=True,
    )
    lines += _backend(
        "workers",
        members,
        policy.balance,
        policy,
        "/v2/health/ready",
        queue_ms=fallback_slo * policy.queue_share,
    )
    if listen.lane_port:
        lines += [
            "backend lane",
            f"    timeout queue {_ms(fallback_slo * policy.queue_share)}",
            "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            f"    server lane 127.0.0.1:{listen.lane_port} {_checks(policy)}",
            "",
        ]
    lines += _submit_backend(members, policy)
    if listen.jobs_in_process:
        lines += _jobs_backend(members, policy)
    if listen.admin_port:
        lines += [
            "backend admin",
            "    timeout server 60s",
            f"    server supervisor 127.0.0.1:{listen.admin_port}",
            "",
        ]
    if listen.grpc_port:
        lines += _grpc(listen, members, policy, fallback_slo * policy.queue_share)
    if listen.stats_port:
        lines += [
            "frontend stats",
            f"    bind 127.0.0.1:{listen.stats_port}",
            "    http-request use-service prometheus-exporter if { path /metrics }",
            "    http-request return status 404",
            "",
        ]
    return "\n".join(lines)


def _global(listen: Listen, policy: FrontDoorPolicy) -> list[str]:
    return [
        "global",
        "    master-worker",
        f"    nbthread {policy.threads}",
        f"    maxconn {policy.max_connections}",
        f"    hard-stop-after {_ms(listen.drain_timeout_s * 1000)}",
        *([f"    server-state-file {listen.state_file}"] if listen.state_file else []),
        "",
    ]


def _defaults(listen: Listen, policy: FrontDoorPolicy) -> list[str]:
    lines = [
        "defaults",
        "    mode http",
        *(["    load-server-state-from-file global"] if listen.state_file else []),
        "    option http-keep-alive",
        # A reload or a drain keeps a client's idle kept-alive connection open until its next
        # request, answered with "Connection: close": closed while idle, a request the client
        # was sending would be lost.
        "    option idle-close-on-response",
        f"    timeout connect {policy.connect_timeout_ms}ms",
        f"    timeout client {_ms(policy.keep_alive_s * 1000)}",
        f"    timeout http-keep-alive {_ms(policy.keep_alive_s * 1000)}",
        f"    timeout http-request {_ms(policy.read_timeout_s * 1000)}",
        f"    timeout server {_ms(policy.request_timeout_s * 1000)}",
        "    timeout queue 1s",
        f"    retries {policy.retries}",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response junk-response 503",
        "    http-reuse always",
    ]
    for status, message in _ERRORS.items():
        retry = " hdr retry-after 1" if status == 503 else ""
        reason = _REFUSALS.get(status)
        if reason is not None:
            retry += f" hdr {REFUSAL_HEADER} {reason}"
            message += f'\\", \\"reason\\": \\"{reason}'
        lines.append(
            f"    http-error status {status} content-type application/json{retry}"
            f' string "{{\\"error\\": \\"{message}\\"}}"'
        )
    return [*lines, ""]


def _frontend(
    listen: Listen, models: dict[str, float], policy: FrontDoorPolicy, laned: frozenset[str]
) -> list[str]:
    lines = [
        "frontend http",
        f"    bind {_address(listen.host)}:{listen.port}",
        f"    maxconn {policy.max_connections}",
        f"    http-request deny deny_status 413 if {{ req.hdr_val(content-length) gt "
        f"{policy.max_body_bytes} }}",
        '    http-request return status 200 content-type application/json string "{}" '
        "if { path /v2/health/live }",
        '    http-request return status 200 content-type application/json string "{}" '
        "if { path /v2/health/ready } { nbsrv(workers) gt 0 }",
        "    http-request return status 503 content-type application/json "
        'string "{\\"error\\": \\"no worker is ready\\"}" if { path /v2/health/ready }',
        # When the front door received the request (µs since the epoch): the worker makes the
        # front door's span of the request's trace from it (docs/observability.md).
        f"    http-request set-header {RECEIVED_HEADER} %[date(0,us)]",
        # The worker that answered (the lane names it itself, with the hedge it may have won).
        f"    http-response set-header {REPLICA_HEADER} %s "
        f"unless {{ res.hdr({REPLICA_HEADER}) -m found }}",
    ]
    if any(policy.policy_of(m) == "affinity" for m in models) or policy.balance == "affinity":
        # The key of the consistent hash: the header, else the body (read whole first).
        lines += [
            "    option http-buffer-request",
            f"    http-request set-var(txn.affinity) req.hdr({AFFINITY_HEADER})",
            "    http-request set-var(txn.affinity) req.body if !{ var(txn.affinity) -m found }",
        ]
    if listen.admin_port:
        paths = " ".join(ADMIN_PATHS)
        prefixes = " ".join(ADMIN_PREFIXES)
        lines.append(f"    use_backend admin if {{ path {paths} }} || {{ path_beg {prefixes} }}")
        if listen.jobs_in_process:
            lines.append(f"    use_backend admin if {{ path {JOBS_PATH} }}")
    if listen.jobs_in_process:
        lines.append(f"    use_backend jobs if {{ path_beg {JOBS_PATH}/ }}")
    # A job's submission does not take one of its model's admission slots: a burst of them
    # queues in a backend of its own, a few at a time a worker.
    lines.append("    use_backend submit if { path_end /jobs } METH_POST")
    for model in models:
        # (Two lines of one name: either matches.)
        lines.append(f"    acl is.{model} path /v2/models/{model}")
        lines.append(f"    acl is.{model} path_beg /v2/models/{model}/ /v1/models/{model}:")
        if model in laned:  # through the lane while it is up, else straight to the workers
            lines.append(f"    use_backend lane if {{ nbsrv(lane) gt 0 }} is.{model}")
        lines.append(f"    use_backend m.{model} if {{ nbsrv(m.{model}) gt 0 }} is.{model}")
        lines.append(f"    use_backend {COLD_BACKEND} if is.{model}")
    return [*lines, "    default_backend workers", ""]


def _backend(
    name: str,
    members: list[Member],
    balance: str,
    policy: FrontDoorPolicy,
    check: str,
    *,
    queue_ms: float,
    by_model: bool = False,
) -> list[str]:
    """A backend of every worker; ``by_model``: each model's requests to one of them (a
    consistent hash of its name), with no retry of a 503 on another."""
    lines = [
        f"backend {name}",
        f"    balance {MODEL_HASH if by_model else BALANCE[balance]}",
        f"    timeout queue {_ms(queue_ms)}",
        # A server's full queue sends the request on to the backend's, which has no bound of
        # its own: refuse at once when the queues together are full.
        f"    http-request deny deny_status 503 if {{ queue ge {policy.max_queue * _serving(members)} }}",  # noqa: E501
        f"    option httpchk GET {check}",
        "    http-check expect status 200",
    ]
    if by_model:
        lines += [
            "    hash-type consistent",
            "    retry-on conn-failure empty-response junk-response",
        ]
    elif balance == "affinity":
        lines += [
            "    hash-type consistent",
            f"    hash-balance-factor {policy.hash_balance_factor}",
        ]
    # (Not for the cold backend: its refusals, 503s, would eject the worker that is loading.)
    observe = (
        "" if by_model else f" observe layer7 error-limit {policy.error_limit} on-error mark-down"
    )
    lines.append(
        f"    default-server {_checks(policy)} "
        f"maxconn {policy.max_conn} maxqueue {policy.max_queue}{observe}"
    )
    lines += [f"    server {m.name} {_address(m.host)}:{m.http_port}{_weight(m)}" for m in members]
    return [*lines, ""]


def _submit_backend(members: list[Member], policy: FrontDoorPolicy) -> list[str]:
    """Job submissions: at most ``submit_conn`` at once a worker (a worker whose online
    requests need its time holds them back), the rest waiting here, for up to
    ``submit_queue_s``, not refused into a client's retry storm."""
    lines = [
        "backend submit",
        f"    balance {BALANCE['p2c']}",
        f"    timeout queue {_ms(policy.submit_queue_s * 1000)}",
        "    option httpchk GET /v2/health/ready",
        "    http-check expect status 200",
        f"    default-server {_checks(policy)} maxconn {policy.submit_conn}",
    ]
    lines += [f"    server {m.name} {_address(m.host)}:{m.http_port}{_weight(m)}" for m in members]
    return [*lines, ""]


def _jobs_backend(members: list[Member], policy: FrontDoorPolicy) -> list[str]:
    """A job's routes to the worker whose name begins its id; an id of a worker that is down or
    gone goes to any (which answers 404: the job was lost with it)."""
    lines = [
        "backend jobs",
        f"    balance {BALANCE['p2c']}",
        "    option httpchk GET /v2/health/live",
        "    http-check expect status 200",
        f"    default-server {_checks(policy)} maxconn {policy.max_conn}",
    ]
    lines += [
        f"    use-server {m.name} if {{ path_beg {JOBS_PATH}/{m.name}. }}"
        for m in members
        if routable(m.name)
    ]
    lines += [f"    server {m.name} {_address(m.host)}:{m.http_port}" for m in members]
    return [*lines, ""]


def _serving(members: list[Member]) -> int:
    return max(1, sum(m.serving for m in members))


# A serving worker's weight (HAProxy's default: every worker alike); out of rotation, 0.
SERVING_WEIGHT = 1


def _weight(member: Member) -> str:
    return "" if member.serving else " weight 0"


def worker_backends(listen: Listen, models: dict[str, float]) -> list[str]:
    """The backends that hold every worker as a server (what a change of rotation touches)."""
    names = [f"m.{model}" for model in sorted(models) if routable(model)]
    names += [COLD_BACKEND, "workers", "submit"]
    return names + (["grpc", "grpc.affinity"] if listen.grpc_port else [])


def _grpc(
    listen: Listen, members: list[Member], policy: FrontDoorPolicy, queue_ms: float
) -> list[str]:
    # A call's model is inside its protobuf body, which HAProxy does not read: gRPC calls share
    # one backend. A call with the affinity key as metadata goes by it, as over HTTP.
    lines = [
        "frontend grpc",
        f"    bind {_address(listen.host)}:{listen.grpc_port} proto h2",
        f"    maxconn {policy.max_connections}",
        f"    http-request set-header {RECEIVED_HEADER} %[date(0,us)]",
        f"    use_backend grpc.affinity if {{ req.hdr({AFFINITY_HEADER}) -m found }}",
        "    default_backend grpc",
        "",
    ]
    for name, balance in (
        ("grpc", [f"    balance {BALANCE['p2c']}"]),
        (
            "grpc.affinity",
            [
                f"    balance hdr({AFFINITY_HEADER})",
                "    hash-type consistent",
                f"    hash-balance-factor {policy.hash_balance_factor}",
            ],
        ),
    ):
        lines += [
            f"backend {name}",
            *balance,
            f"    timeout queue {_ms(queue_ms)}",
            "    option httpchk GET /v2/health/ready",
            "    http-check expect status 200",
            f"    default-server {_checks(policy)} "
            f"maxconn {policy.max_conn} maxqueue {policy.max_queue}",
        ]
        lines += [
            f"    server {m.name} {_address(m.host)}:{m.grpc_port} proto h2 "
            f"check port {m.http_port} check-proto h1{_weight(m)}"
            for m in members
            if m.grpc_port
        ]
        lines.append("")
    return lines


def _checks(policy: FrontDoorPolicy) -> str:
    return (
        f"check inter {policy.check_interval_ms}ms downinter {policy.down_check_interval_ms}ms "
        "fall 2 rise 1"
    )


def _address(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _ms(value: float) -> str:
    return f"{max(1, round(value))}ms"
