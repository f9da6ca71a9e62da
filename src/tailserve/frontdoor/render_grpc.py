"""The front door's gRPC side: calls over HTTP/2 end to end, routed by the model they name.

HAProxy reads no protobuf, but a unary call's model is at a fixed place in its one message: the
5-byte gRPC frame header, then field 1 (``ModelInferRequest.model_name``, and the ``name`` of
``ModelReady``, ``ModelMetadata``, ``ModelConfig`` and ``ModelStatistics`` requests), which
protobuf writers put first: its tag (``0x0A``), its length, the name. The frontend waits for
that prefix of the body (not for the whole: a large tensor is forwarded as it arrives) and
compares it with each model's bytes. The mapping, as over HTTP (`frontdoor.render`):

- one backend a model (``g.<model>``), each worker's gRPC port checked with the model's own
  readiness route on its HTTP port; the model's balancing policy (affinity: the
  ``x-affinity-key`` metadata, else the message); at most ``max_conn`` calls in flight a worker
  and a queue of ``max_queue`` waited in for a share of the SLO, then refused at once;
- a model ready on no worker: ``grpc.cold``, one worker chosen by a hash of the model's name;
- outlier ejection: HAProxy's ``observe layer7`` sees HTTP statuses, and a gRPC error comes
  with status 200, its ``grpc-status`` in the response's headers (a call that failed before
  any message is answered "trailers-only": one block of headers). A Lua action
  (``grpc_ejection.lua``) counts a worker's failures in a row (UNKNOWN, DEADLINE_EXCEEDED,
  INTERNAL, UNAVAILABLE: HTTP's 500, 504 and 503) and past ``error_limit`` marks it down until
  its checks pass again, as ``observe layer7`` does;
- the front door's own refusals as gRPC statuses (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL),
  saying why in ``grpc-message`` and ``x-refusal-reason``, not as bare HTTP errors;
- ``ModelStreamInfer`` to ``grpc.stream``: a stream is one long HTTP/2 request that may carry
  any model, so it takes the worker with the fewest streams and no admission slot (each of its
  requests is admitted by the worker); with an affinity key, by the key;
- anything else (server health and metadata, a model HAProxy cannot name, a compressed message)
  to ``grpc``, every worker; with an affinity key, ``grpc.affinity``, by the key.

A unary call reaches the worker over HTTP/1.1 on its HTTP port (`protocols.grpc.over_http1`:
the message framed as gRPC frames it, the status as a trailer): HAProxy converts HTTP/2 to
HTTP/1.1 and back in C, and the worker's HTTP server answers it for the CPU of an HTTP request
with a binary body, where grpcio's server cost 1.3-1.7x an HTTP/JSON request's. A stream goes
to the worker's gRPC port over HTTP/2: HTTP/1.1 does not carry a stream both ways at once.
"""

from __future__ import annotations

from tailserve.frontdoor.policy import (
    AFFINITY_HEADER,
    BALANCE,
    ERRORS,
    RECEIVED_HEADER,
    REFUSAL_HEADER,
    REFUSALS,
    FrontDoorPolicy,
    Listen,
    Member,
    address,
    checks,
    ms,
    routable,
    weight,
)

SERVICE = "/inference.GRPCInferenceService/"
# The calls whose one message begins with the model's name.
UNARY_BY_MODEL = tuple(
    SERVICE + name
    for name in ("ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
)
STREAM = SERVICE + "ModelStreamInfer"
# A name this long still has a one-byte length (a protobuf varint under 128).
MAX_NAME_BYTES = 127
# The frame header (5 bytes), the field's tag and length (2), the longest name.
PREFIX_BYTES = 5 + 2 + MAX_NAME_BYTES
COLD = "grpc.cold"
# HAProxy's own errors as gRPC statuses: (status, its code).
GRPC_STATUS = {400: 13, 408: 4, 500: 13, 502: 14, 503: 14, 504: 4}
# The gRPC statuses that count against a worker (UNKNOWN, DEADLINE_EXCEEDED, INTERNAL,
# UNAVAILABLE), as HTTP's 5xx do.
FAILURES = (2, 4, 13, 14)


def grpc_routable(model: str) -> bool:
    """Whether a model's calls can be told apart at the front door (else they go to ``grpc``)."""
    return routable(model) and len(model.encode()) <= MAX_NAME_BYTES


def name_prefix(model: str) -> str:
    """A model's name as a unary call's message has it after the frame header, in hex."""
    raw = model.encode()
    return (bytes((0x0A, len(raw))) + raw).hex().upper()


def backends(listen: Listen, models: dict[str, float]) -> list[str]:
    """The gRPC backends that hold every worker (for a change of rotation)."""
    if not listen.grpc_port:
        return []
    named = [f"g.{model}" for model in sorted(models) if grpc_routable(model)]
    return [*named, COLD, "grpc", "grpc.affinity", "grpc.stream"]


def shared_backends(listen: Listen) -> list[str]:
    """The gRPC backends that every model's calls may take (whatever the model)."""
    return [COLD, "grpc", "grpc.affinity", "grpc.stream"] if listen.grpc_port else []


def render_grpc(
    listen: Listen, members: list[Member], models: dict[str, float], policy: FrontDoorPolicy
) -> list[str]:
    """The gRPC frontend and its backends, for ``models`` (name -> SLO p99 in ms)."""
    named = {m: slo for m, slo in sorted(models.items()) if grpc_routable(m)}
    fallback_ms = max(named.values(), default=1000.0) * policy.queue_share
    lines = _frontend(listen, named, policy, await_ms=fallback_ms)
    for model, slo_ms in named.items():
        lines += _backend(
            f"g.{model}",
            members,
            policy,
            balance=_balance(policy.policy_of(model), policy),
            check=f"/v2/models/{model}/ready",
            queue_ms=slo_ms * policy.queue_share,
            eject=bool(listen.grpc_ejection),
        )
    lines += _backend(
        COLD,
        members,
        policy,
        balance=["    balance hash var(txn.model)", "    hash-type consistent"],
        check="/v2/health/ready",
        queue_ms=fallback_ms,
        eject=False,  # (its refusals, while a worker loads the model, would eject it)
    )
    lines += _backend(
        "grpc",
        members,
        policy,
        balance=[f"    balance {BALANCE['p2c']}"],
        check="/v2/health/ready",
        queue_ms=fallback_ms,
        eject=bool(listen.grpc_ejection),
    )
    lines += _backend(
        "grpc.affinity",
        members,
        policy,
        balance=[f"    balance hdr({AFFINITY_HEADER})", *_consistent(policy)],
        check="/v2/health/ready",
        queue_ms=fallback_ms,
        eject=bool(listen.grpc_ejection),
    )
    return lines + _stream_backend(members, policy)


def _frontend(
    listen: Listen, models: dict[str, float], policy: FrontDoorPolicy, *, await_ms: float
) -> list[str]:
    affinity = policy.balance == "affinity" or any(
        policy.policy_of(m) == "affinity" for m in models
    )
    # An affinity key from the message needs it whole (as far as a buffer holds it); else the
    # name's bytes are enough.
    at_least = "" if affinity else f" at-least {PREFIX_BYTES}"
    lines = [
        "frontend grpc",
        f"    bind {address(listen.host)}:{listen.grpc_port} proto h2",
        f"    maxconn {policy.max_connections}",
        *_errors(),
        f"    http-request set-header {RECEIVED_HEADER} %[date(0,us)]",
        f"    acl grpc.unary path {' '.join(UNARY_BY_MODEL)}",
        f"    acl grpc.stream path {STREAM}",
        f"    acl grpc.keyed req.hdr({AFFINITY_HEADER}) -m found",
        f"    http-request wait-for-body time {ms(policy.read_timeout_s * 1000)}{at_least} "
        "if grpc.unary",
    ]
    if affinity:
        lines += [
            f"    http-request set-var(txn.affinity) req.hdr({AFFINITY_HEADER})",
            "    http-request set-var(txn.affinity) req.body "
            "if grpc.unary !{ var(txn.affinity) -m found }",
        ]
    for model in models:
        size = 2 + len(model.encode())
        lines.append(
            f"    http-request set-var(txn.model) str({model}) if grpc.unary "
            f"{{ req.body,bytes(5,{size}),hex -m str {name_prefix(model)} }}"
        )
    # The front door's own readiness: a worker would answer ServerReady for itself alone.
    asked = f"{{ path {SERVICE}ServerReady }}"
    down = " || ".join(f"{asked} {{ nbsrv({name}) eq 0 }}" for name in shared_backends(listen))
    lines.append(
        f"    http-request return status 200 "
        f'hdr grpc-status {GRPC_STATUS[503]} hdr grpc-message "the front door is not ready: '
        f'not every backend has a worker ready yet" if {down}'
    )
    if listen.await_server:
        # No worker up: a call waits a while, within its deadline, rather than fail at once.
        shared = shared_backends(listen)
        down = " || ".join(f"{{ nbsrv({name}) eq 0 }}" for name in shared)
        lines.append(
            f"    http-request lua.await_server {','.join(shared)} {round(await_ms)} if {down}"
        )
    lines.append("    use_backend grpc.affinity if grpc.keyed grpc.stream")
    lines.append("    use_backend grpc.stream if grpc.stream")
    for model in models:
        lines.append(
            f"    use_backend g.{model} if {{ var(txn.model) -m str {model} }} "
            f"{{ nbsrv(g.{model}) gt 0 }}"
        )
    lines += [
        f"    use_backend {COLD} if {{ var(txn.model) -m found }}",
        "    use_backend grpc.affinity if grpc.keyed",
        "    default_backend grpc",
        "",
    ]
    return lines


def _balance(name: str, policy: FrontDoorPolicy) -> list[str]:
    lines = [f"    balance {BALANCE[name]}"]
    return [*lines, *_consistent(policy)] if name == "affinity" else lines


def _consistent(policy: FrontDoorPolicy) -> list[str]:
    return ["    hash-type consistent", f"    hash-balance-factor {policy.hash_balance_factor}"]


def _backend(
    name: str,
    members: list[Member],
    policy: FrontDoorPolicy,
    *,
    balance: list[str],
    check: str,
    queue_ms: float,
    eject: bool,
) -> list[str]:
    lines = [
        f"backend {name}",
        *balance,
        f"    timeout queue {ms(queue_ms)}",
        *_errors(),
        # The queues full: refused at once (past a worker's own queue, a call would wait in
        # the backend's, which has no bound). Per worker up and in rotation.
        f"    http-request deny deny_status 503 if {{ avg_queue ge {policy.max_queue} }}",
        f"    option httpchk GET {check}",
        "    http-check expect status 200",
    ]
    if eject:
        lines.append(f"    http-response lua.grpc_outcome {policy.error_limit}")
    lines.append(
        f"    default-server {checks(policy)} maxconn {policy.max_conn} maxqueue {policy.max_queue}"
    )
    return [*lines, *_http_servers(members), ""]


def _stream_backend(members: list[Member], policy: FrontDoorPolicy) -> list[str]:
    """Streams: to the worker with the fewest, none refused at the door (a stream holds its
    connection for its life; the worker admits each request on it)."""
    lines = [
        "backend grpc.stream",
        f"    balance {BALANCE['least-loaded']}",
        *_errors(),
        "    option httpchk GET /v2/health/ready",
        "    http-check expect status 200",
        f"    default-server {checks(policy)}",
    ]
    return [*lines, *_servers(members), ""]


def _http_servers(members: list[Member]) -> list[str]:
    """Each worker's HTTP port, spoken to in HTTP/1.1: a unary call goes there as a POST
    (`protocols.grpc.over_http1`), HAProxy turning HTTP/2 into HTTP/1.1 and back."""
    return [
        f"    server {m.name} {address(m.host)}:{m.http_port} check{weight(m)}"
        for m in members
        if m.grpc_port
    ]


def _servers(members: list[Member]) -> list[str]:
    return [
        f"    server {m.name} {address(m.host)}:{m.grpc_port} proto h2 "
        f"check port {m.http_port} check-proto h1{weight(m)}"
        for m in members
        if m.grpc_port
    ]


def _errors() -> list[str]:
    """HAProxy's own errors as gRPC statuses (a gRPC client reads ``grpc-status`` from the
    headers of an error answered at once, whatever its HTTP status)."""
    lines = []
    for status, message in ERRORS.items():
        extra = ""
        reason = REFUSALS.get(status)
        if reason is not None:
            extra = f" hdr {REFUSAL_HEADER} {reason}"
        if status == 503:
            extra += " hdr retry-after 1"
        lines.append(
            f"    http-error status {status} hdr grpc-status {GRPC_STATUS[status]} "
            f'hdr grpc-message "{message}"{extra}'
        )
    return lines
