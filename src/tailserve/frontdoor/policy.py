"""The front door's policy and its members: what `frontdoor.render` and `frontdoor.render_grpc`
render into HAProxy's config, with the small pieces of config text both write."""

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
# What HAProxy may put in a backend's name and a path's ACL without quoting.
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# Stamped on every request: when the front door received it, in µs since the epoch.
RECEIVED_HEADER = "x-frontdoor-received-us"
REFUSAL_HEADER = "x-refusal-reason"
# The front door's own refusals, as x-refusal-reason says them.
REFUSALS = {503: "frontdoor_full", 504: "frontdoor_timeout"}
ERRORS = {
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
    # Jobs live in each worker's memory, not in Redis (see `frontdoor.render`'s docstring).
    jobs_in_process: bool = False
    # The Lua script that ejects a worker failing gRPC calls (`frontdoor.render_grpc`; "":
    # none, gRPC calls then eject no worker).
    grpc_ejection: str = ""
    # The Lua script that holds a request while no worker is up, within its deadline
    # (`frontdoor.render`; "": none, such a request gets a 503 at once).
    await_server: str = ""


def routable(model: str) -> bool:
    """Whether a model's name can be a backend of its own (else the default backend serves)."""
    return bool(_NAME.match(model))


# A serving worker's weight (HAProxy's default: every worker alike); out of rotation, 0.
SERVING_WEIGHT = 1


def weight(member: Member) -> str:
    return "" if member.serving else " weight 0"


def checks(policy: FrontDoorPolicy) -> str:
    return (
        f"check inter {policy.check_interval_ms}ms downinter {policy.down_check_interval_ms}ms "
        "fall 2 rise 1"
    )


def address(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def ms(value: float) -> str:
    return f"{max(1, round(value))}ms"


# The server state file's columns (HAProxy's `show servers state`, format 1).
STATE_COLUMNS = (
    "be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight "
    "srv_iweight srv_time_since_last_change srv_check_status srv_check_result "
    "srv_check_health srv_check_state srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn "
    "srv_port srvrecord srv_use_ssl srv_check_port srv_check_addr srv_agent_addr srv_agent_port"
)
_SERVER = re.compile(r"^\s+server (\S+) (\S+):(\d+)(.*)$")
_CHECK_PORT = re.compile(r"\bcheck port (\d+)")


def down_state(config: str) -> str:
    """A server state file that has every server of ``config`` down until its first check
    passes.

    HAProxy takes a server for up until a check fails, and spreads a backend's first checks
    over its check interval: for most of a second after it starts, a worker that is not
    listening yet would count as up, and the ready route would say yes. Loaded at start
    (``load-server-state-from-file``), this makes every server earn its place. A server is
    found by its backend's and its own name; ids are not compared.
    """
    rows = []
    backend, checked = "", False
    for line in config.splitlines():
        if line and not line[0].isspace():  # a section's head: servers count in a backend
            backend = line.split()[1] if line.startswith("backend ") else ""
            checked = False
            continue
        if line.strip().startswith("default-server ") and " check" in f" {line.strip()}":
            checked = True
        found = _SERVER.match(line)
        # (A server with no checks, as the admin lane's, has nothing to bring it up.)
        if not backend or found is None or not (checked or " check" in found.group(4)):
            continue
        name, host, port, rest = found.groups()
        weight = 0 if " weight 0" in rest else SERVING_WEIGHT
        check = _CHECK_PORT.search(rest)
        check_port = check.group(1) if check else "0"
        host = host.strip("[]")
        # op state 0 (stopped), admin state 0, check health 0 (a check must pass to rise).
        rows.append(
            f"0 {backend} 0 {name} {host} 0 0 {weight} {weight} 0 1 0 0 0 0 0 0 - {port} - 0 "
            f"{check_port} - - 0"
        )
    return "\n".join(["1", f"# {STATE_COLUMNS}", *rows, ""])
