"""The front door's configuration: tailserve's routing policies written as an HAProxy config.

The front door is HAProxy (a C proxy: no Python parses a request on the hop). This module is
pure: it turns the fleet's members, its models and the policy into the text of a config, which
`frontdoor.haproxy` writes, checks and loads. The mapping:

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
- gRPC over HTTP/2 to the workers' gRPC ports, by the model each call names, with the same
  policies (`frontdoor.render_grpc`);
- HAProxy's own Prometheus exporter on a loopback port, for the admin lane to merge.
"""

from __future__ import annotations

from tailserve.frontdoor.policy import (
    AFFINITY_HEADER,
    BALANCE,
    ERRORS,
    RECEIVED_HEADER,
    REFUSAL_HEADER,
    REFUSALS,
    REPLICA_HEADER,
    SERVING_WEIGHT,
    FrontDoorPolicy,
    Listen,
    Member,
    routable,
)
from tailserve.frontdoor.policy import address as _address
from tailserve.frontdoor.policy import checks as _checks
from tailserve.frontdoor.policy import ms as _ms
from tailserve.frontdoor.policy import weight as _weight
from tailserve.frontdoor.render_grpc import backends as grpc_backends
from tailserve.frontdoor.render_grpc import render_grpc
from tailserve.frontdoor.render_grpc import shared_backends as grpc_shared_backends

__all__ = [
    "AFFINITY_HEADER",
    "BALANCE",
    "RECEIVED_HEADER",
    "REFUSAL_HEADER",
    "REPLICA_HEADER",
    "SERVING_WEIGHT",
    "FrontDoorPolicy",
    "Listen",
    "Member",
    "render",
    "routable",
    "worker_backends",
]

# The routes the supervisor answers itself (its admin lane), by path prefix or path.
ADMIN_PATHS = ("/metrics", "/v2/fleet", "/dashboard")
ADMIN_PREFIXES = ("/v2/cache/", "/v2/repository/", "/dashboard/")
JOBS_PATH = "/v2/jobs"
# The backend of the models ready on no worker, and its choice of worker: a hash of the model's
# name, the fourth field of /v2/models/NAME/... and /v1/models/NAME:predict.
COLD_BACKEND = "cold"
MODEL_HASH = "hash path,field(4,/),field(1,:)"
# The HTTP backends whatever the model: any model's requests may take them.
SHARED_BACKENDS = ("workers", COLD_BACKEND, "submit")


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
        lines += render_grpc(listen, members, named, policy)
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
        *([f"    lua-load {listen.grpc_ejection}"] if _ejects_grpc(listen) else []),
        *([f"    lua-load {listen.await_server}"] if listen.await_server else []),
        "",
    ]


def _ejects_grpc(listen: Listen) -> bool:
    return bool(listen.grpc_port and listen.grpc_ejection)


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
    for status, message in ERRORS.items():
        retry = " hdr retry-after 1" if status == 503 else ""
        reason = REFUSALS.get(status)
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
        f"if {{ path /v2/health/ready }} {ready_condition(listen)}",
        "    http-request return status 503 content-type application/json "
        'string "{\\"error\\": \\"not every backend has a worker ready yet\\"}" '
        "if { path /v2/health/ready }",
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
    if listen.await_server:
        # No worker up (each restarting, or none ready yet): the request waits a while,
        # within its deadline, rather than get a 503 at once. (Not the fleet's own routes.)
        lines += [
            *(f"    acl door.down nbsrv({name}) eq 0" for name in SHARED_BACKENDS),
            f"    acl door.own path_beg /v2/health/ {' '.join(ADMIN_PREFIXES)}",
            f"    acl door.own path {' '.join(ADMIN_PATHS)} {JOBS_PATH}",
            f"    http-request lua.await_server {','.join(SHARED_BACKENDS)} "
            f"{round(await_ms(models, policy))} if door.down !door.own",
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
        # its own: refuse at once when the queues together are full (per worker up and in
        # rotation: a worker down or out takes no share).
        f"    http-request deny deny_status 503 if {{ avg_queue ge {policy.max_queue} }}",
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


def ready_condition(listen: Listen) -> str:
    """The front door is ready when every backend a request may take has a worker up: a
    model's requests go to its own backend where it is ready, else to the cold one, so with
    these up, a request for any model that is ready somewhere is routed and served."""
    shared = [*SHARED_BACKENDS, *grpc_shared_backends(listen)]
    return " ".join(f"{{ nbsrv({name}) gt 0 }}" for name in shared)


def await_ms(models: dict[str, float], policy: FrontDoorPolicy) -> float:
    """How long a request with no deadline of its own waits for a worker to come up: as long
    as the longest any model's may wait in a queue."""
    return max(models.values(), default=1000.0) * policy.queue_share


def worker_backends(listen: Listen, models: dict[str, float]) -> list[str]:
    """The backends that hold every worker as a server (what a change of rotation touches)."""
    names = [f"m.{model}" for model in sorted(models) if routable(model)]
    return [*names, COLD_BACKEND, "workers", "submit", *grpc_backends(listen, models)]
