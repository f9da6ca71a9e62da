"""The front door's config: each routing policy as HAProxy config lines, checked by HAProxy."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import subprocess
from pathlib import Path

import pytest
from tritonclient.grpc import service_pb2

from tailserve.errors import ConfigError
from tailserve.frontdoor.haproxy import (
    HAProxy,
    await_server_script,
    find_binary,
    grpc_ejection_script,
)
from tailserve.frontdoor.policy import down_state
from tailserve.frontdoor.render import FrontDoorPolicy, Listen, Member, render, worker_backends
from tailserve.frontdoor.render_grpc import MAX_NAME_BYTES, name_prefix

MEMBERS = [Member("worker-0", "127.0.0.1", 9001, 9101), Member("worker-1", "127.0.0.1", 9002, 9102)]
LISTEN = Listen(host="127.0.0.1", port=8080, grpc_port=8081, admin_port=9200, stats_port=9201)


def backend(config: str, name: str) -> list[str]:
    """The lines of one backend (or frontend) section."""
    lines = config.splitlines()
    start = lines.index(name)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return [line.strip() for line in lines[start + 1 : end]]


def test_each_model_has_a_backend_checked_by_its_own_readiness() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0, "sentiment": 200.0}, FrontDoorPolicy())
    churn = backend(config, "backend m.churn")
    assert "option httpchk GET /v2/models/churn/ready" in churn
    assert "server worker-0 127.0.0.1:9001" in churn and "server worker-1 127.0.0.1:9002" in churn
    assert "option httpchk GET /v2/models/sentiment/ready" in backend(config, "backend m.sentiment")
    front = backend(config, "frontend http")
    assert "acl is.churn path /v2/models/churn" in front
    assert "acl is.churn path_beg /v2/models/churn/ /v1/models/churn:" in front
    assert "use_backend m.churn if { nbsrv(m.churn) gt 0 } is.churn" in front


def test_a_model_ready_on_no_worker_goes_to_one_worker_by_its_name() -> None:
    # Workers under a memory budget load models on demand: a model loaded nowhere must still
    # reach one worker (one, not each in turn), and its refusal is not retried elsewhere.
    config = render(LISTEN, MEMBERS, {"churn": 50.0, "sentiment": 200.0}, FrontDoorPolicy())
    front = backend(config, "frontend http")
    loaded = front.index("use_backend m.churn if { nbsrv(m.churn) gt 0 } is.churn")
    assert front.index("use_backend cold if is.churn") == loaded + 1
    assert "use_backend cold if is.sentiment" in front
    cold = backend(config, "backend cold")
    assert "balance hash path,field(4,/),field(1,:)" in cold
    assert "hash-type consistent" in cold
    assert "option httpchk GET /v2/health/ready" in cold
    assert "retry-on conn-failure empty-response junk-response" in cold
    (defaults,) = [line for line in cold if line.startswith("default-server")]
    assert "observe" not in defaults  # a refusal must not eject the worker that is loading
    assert "server worker-0 127.0.0.1:9001" in cold and "server worker-1 127.0.0.1:9002" in cold
    assert "cold" in worker_backends(LISTEN, {"churn": 50.0})


def test_admission_is_a_bounded_queue_timed_by_the_models_slo() -> None:
    policy = FrontDoorPolicy(max_conn=8, max_queue=20, queue_share=0.5)
    config = render(LISTEN, MEMBERS, {"churn": 50.0, "sentiment": 200.0}, policy)
    churn = backend(config, "backend m.churn")
    assert "timeout queue 25ms" in churn
    assert "timeout queue 100ms" in backend(config, "backend m.sentiment")
    (defaults,) = [line for line in churn if line.startswith("default-server")]
    assert "maxconn 8 maxqueue 20" in defaults
    assert "observe layer7 error-limit 10 on-error mark-down" in defaults
    # An overflowing queue answers at once, in JSON, with Retry-After.
    assert any(
        line.startswith("http-error status 503 content-type application/json hdr retry-after 1")
        for line in backend(config, "defaults")
    )


@pytest.mark.parametrize(
    ("policy", "line"),
    [
        ("p2c", "balance random(2)"),
        ("round-robin", "balance roundrobin"),
        ("least-loaded", "balance leastconn"),
        ("affinity", "balance hash var(txn.affinity)"),
    ],
)
def test_balancing_policies_map_onto_haproxy(policy: str, line: str) -> None:
    config = render(
        LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy(model_balance={"churn": policy})
    )
    assert line in backend(config, "backend m.churn")
    assert "balance random(2)" in backend(config, "backend workers")


def test_affinity_hashes_the_header_else_the_body_with_bounded_load() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy(balance="affinity"))
    churn = backend(config, "backend m.churn")
    assert "hash-type consistent" in churn and "hash-balance-factor 125" in churn
    front = backend(config, "frontend http")
    assert "http-request set-var(txn.affinity) req.hdr(x-affinity-key)" in front
    assert "http-request set-var(txn.affinity) req.body if !{ var(txn.affinity) -m found }" in front
    assert "option http-buffer-request" in front


def test_the_fleets_routes_go_to_the_admin_lane_and_grpc_calls_to_the_workers_http_ports() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())
    front = backend(config, "frontend http")
    assert (
        "use_backend admin if { path /metrics /v2/fleet /dashboard } || "
        "{ path_beg /v2/cache/ /v2/repository/ /dashboard/ }"
    ) in front
    assert "server supervisor 127.0.0.1:9200" in backend(config, "backend admin")
    # A unary call goes over HTTP/1.1 to the worker's HTTP port, a stream over HTTP/2 to its
    # gRPC port.
    assert "server worker-0 127.0.0.1:9001 check" in backend(config, "backend grpc")
    stream = backend(config, "backend grpc.stream")
    assert "server worker-0 127.0.0.1:9101 proto h2 check port 9001 check-proto h1" in stream
    assert "bind 127.0.0.1:8081 proto h2" in backend(config, "frontend grpc")


def test_a_grpc_call_with_an_affinity_key_goes_by_it() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())
    front = backend(config, "frontend grpc")
    assert "acl grpc.keyed req.hdr(x-affinity-key) -m found" in front
    # A stream, or a call for no model the door knows, with the key: by the key.
    assert "use_backend grpc.affinity if grpc.keyed grpc.stream" in front
    assert front.index("use_backend grpc.affinity if grpc.keyed") > front.index(
        "use_backend g.churn if { var(txn.model) -m str churn } { nbsrv(g.churn) gt 0 }"
    )
    affinity = backend(config, "backend grpc.affinity")
    assert "balance hdr(x-affinity-key)" in affinity and "hash-type consistent" in affinity
    assert any(line.startswith("server worker-1 127.0.0.1:9002 check") for line in affinity)
    assert "balance random(2)" in backend(config, "backend grpc")
    # A model whose policy is affinity: the key, else the message, as over HTTP.
    keyed = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy(balance="affinity"))
    front = backend(keyed, "frontend grpc")
    assert "http-request set-var(txn.affinity) req.hdr(x-affinity-key)" in front
    assert "balance hash var(txn.affinity)" in backend(keyed, "backend g.churn")


@pytest.mark.parametrize("kind", ["ModelInferRequest", "ModelReadyRequest", "ModelMetadataRequest"])
def test_a_unary_calls_message_begins_with_its_models_name(kind: str) -> None:
    # What the door compares is what a client sends: the frame header, then field 1.
    field = "model_name" if kind == "ModelInferRequest" else "name"
    message = getattr(service_pb2, kind)(**{field: "churn"})
    if kind == "ModelInferRequest":
        message.id = "request-7"
        message.inputs.add(name="x", datatype="FP32", shape=[1, 1])
    body = message.SerializeToString()
    framed = b"\x00" + len(body).to_bytes(4, "big") + body
    assert framed[5:12].hex().upper() == name_prefix("churn") == "0A05636875726E"
    front = backend(render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy()), "frontend grpc")
    assert (
        "http-request set-var(txn.model) str(churn) if grpc.unary "
        "{ req.body,bytes(5,7),hex -m str 0A05636875726E }"
    ) in front
    (unary,) = [line for line in front if line.startswith("acl grpc.unary path")]
    assert f"/inference.GRPCInferenceService/{kind.removesuffix('Request')}" in unary.split()


def test_each_model_has_a_grpc_backend_with_the_admission_and_ejection_of_http() -> None:
    listen = dataclasses.replace(LISTEN, grpc_ejection="/opt/grpc_ejection.lua")
    policy = FrontDoorPolicy(max_conn=8, max_queue=20, queue_share=0.5, error_limit=5)
    config = render(listen, MEMBERS, {"churn": 50.0, "sentiment": 200.0}, policy)
    assert "lua-load /opt/grpc_ejection.lua" in backend(config, "global")
    churn = backend(config, "backend g.churn")
    assert "option httpchk GET /v2/models/churn/ready" in churn
    assert "timeout queue 25ms" in churn
    assert "timeout queue 100ms" in backend(config, "backend g.sentiment")
    assert "http-request deny deny_status 503 if { avg_queue ge 20 }" in churn
    assert "http-response lua.grpc_outcome 5" in churn
    (defaults,) = [line for line in churn if line.startswith("default-server")]
    assert "maxconn 8 maxqueue 20" in defaults
    assert "server worker-0 127.0.0.1:9001 check" in churn
    # The door's refusals are gRPC statuses, saying why.
    assert (
        'http-error status 503 hdr grpc-status 14 hdr grpc-message "no worker can take the '
        "request in time: every worker is busy and its queue full, or none is ready; retry "
        'later" hdr x-refusal-reason frontdoor_full hdr retry-after 1'
    ) in churn
    # Ready nowhere: one worker by the model's name, whose refusals eject no one.
    cold = backend(config, "backend grpc.cold")
    assert "balance hash var(txn.model)" in cold
    assert not any("lua.grpc_outcome" in line for line in cold)
    # No script: no ejection.
    plain = render(LISTEN, MEMBERS, {"churn": 50.0}, policy)
    assert "lua-load" not in plain and "lua.grpc_outcome" not in plain


def test_streams_go_to_the_worker_with_the_fewest_and_take_no_admission_slot() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())
    front = backend(config, "frontend grpc")
    assert "use_backend grpc.stream if grpc.stream" in front
    stream = backend(config, "backend grpc.stream")
    assert "balance leastconn" in stream
    (defaults,) = [line for line in stream if line.startswith("default-server")]
    assert "maxconn" not in defaults and "maxqueue" not in defaults
    assert not any(line.startswith(("timeout queue", "http-request deny")) for line in stream)


def test_a_name_too_long_for_one_length_byte_goes_to_the_default_grpc_backend() -> None:
    long = "m" * (MAX_NAME_BYTES + 1)
    config = render(LISTEN, MEMBERS, {"churn": 50.0, long: 50.0}, FrontDoorPolicy())
    assert f"backend g.{long}" not in config and f"backend m.{long}" in config
    assert worker_backends(LISTEN, {"churn": 50.0}) == [
        "m.churn",
        "cold",
        "workers",
        "submit",
        "g.churn",
        "grpc.cold",
        "grpc",
        "grpc.affinity",
        "grpc.stream",
    ]


def test_a_model_name_haproxy_cannot_hold_goes_to_the_default_backend() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0, "odd name": 50.0}, FrontDoorPolicy())
    assert "backend m.odd name" not in config
    assert "backend m.churn" in config


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="unknown balancing policy 'fastest'"):
        FrontDoorPolicy(balance="fastest")


def test_job_submissions_skip_the_models_admission_slots() -> None:
    front = backend(render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy()), "frontend http")
    submit = front.index("use_backend submit if { path_end /jobs } METH_POST")
    assert submit < front.index("use_backend m.churn if { nbsrv(m.churn) gt 0 } is.churn")
    backend_lines = backend(
        render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy()), "backend submit"
    )
    assert "timeout queue 30000ms" in backend_lines
    assert any(line.startswith("default-server") and "maxconn 4" in line for line in backend_lines)


def test_in_process_jobs_go_back_to_the_worker_their_id_names() -> None:
    listen = Listen(host="127.0.0.1", port=8080, admin_port=9200, jobs_in_process=True)
    config = render(listen, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())
    front = backend(config, "frontend http")
    assert "use_backend admin if { path /v2/jobs }" in front  # the list, from every worker
    assert "use_backend jobs if { path_beg /v2/jobs/ }" in front
    jobs = backend(config, "backend jobs")
    assert "use-server worker-0 if { path_beg /v2/jobs/worker-0. }" in jobs
    assert "use-server worker-1 if { path_beg /v2/jobs/worker-1. }" in jobs
    assert "server worker-1 127.0.0.1:9002" in jobs
    shared = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())  # Redis: any worker
    assert "backend jobs" not in shared


@pytest.mark.parametrize("jobs_in_process", [False, True])
@pytest.mark.parametrize("balance", ["p2c", "affinity", "round-robin", "least-loaded"])
def test_haproxy_accepts_the_config(balance: str, jobs_in_process: bool, tmp_path: Path) -> None:
    config = render(
        Listen(
            host="0.0.0.0",
            port=8080,
            grpc_port=8081,
            admin_port=9200,
            stats_port=9201,
            jobs_in_process=jobs_in_process,
            grpc_ejection=grpc_ejection_script(),
            await_server=await_server_script(),
        ),
        MEMBERS,
        {"churn": 50.0, "sentiment": 200.0},
        FrontDoorPolicy(balance=balance, max_connections=1000),
    )
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    checked = subprocess.run(
        [find_binary(), "-c", "-f", str(path)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "[WARNING]" not in checked.stdout + checked.stderr


def test_ready_means_every_shared_backend_has_a_worker_up_http_and_grpc() -> None:
    config = render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())
    (ready,) = [
        line
        for line in backend(config, "frontend http")
        if line.startswith("http-request return status 200") and "/v2/health/ready" in line
    ]
    for name in ("workers", "cold", "submit", "grpc", "grpc.cold", "grpc.affinity", "grpc.stream"):
        assert f"{{ nbsrv({name}) gt 0 }}" in ready
    grpc = backend(config, "frontend grpc")
    (unready,) = [line for line in grpc if "ServerReady" in line]
    assert "grpc-status 14" in unready and "{ nbsrv(grpc.stream) eq 0 }" in unready
    no_grpc = render(
        dataclasses.replace(LISTEN, grpc_port=0), MEMBERS, {"churn": 50.0}, FrontDoorPolicy()
    )
    assert "nbsrv(grpc" not in no_grpc


def test_with_no_worker_up_a_request_waits_for_one_but_the_fleets_routes_do_not() -> None:
    listen = dataclasses.replace(LISTEN, await_server="/run/await_server.lua")
    config = render(listen, MEMBERS, {"churn": 50.0, "sentiment": 200.0}, FrontDoorPolicy())
    assert "    lua-load /run/await_server.lua" in config.splitlines()
    front = backend(config, "frontend http")
    # As long as the longest queue wait (200 ms x 0.5) unless the request says its deadline.
    assert "http-request lua.await_server workers,cold,submit 100 if door.down !door.own" in front
    assert "acl door.own path /metrics /v2/fleet /dashboard /v2/jobs" in front
    grpc = backend(config, "frontend grpc")
    assert any(line.startswith("http-request lua.await_server grpc.cold,grpc,") for line in grpc)
    assert "lua.await_server" not in render(LISTEN, MEMBERS, {"churn": 50.0}, FrontDoorPolicy())


def test_the_first_state_has_every_server_down_with_its_address_weight_and_check_port() -> None:
    standby = Member("worker-2", "::1", 9003, 9103, serving=False)
    config = render(LISTEN, [*MEMBERS, standby], {"churn": 50.0}, FrontDoorPolicy())
    rows = [line.split() for line in down_state(config).splitlines()[2:] if line]
    by_place = {(row[1], row[3]): row for row in rows}
    # Every server of every backend that checks it; not the admin lane's, which has no
    # checks to bring it up.
    servers = sum(1 for line in config.splitlines() if line.strip().startswith("server "))
    assert len(rows) == servers - 1
    assert ("admin", "supervisor") not in by_place
    churn = by_place[("m.churn", "worker-0")]
    assert churn[4:9] == ["127.0.0.1", "0", "0", "1", "1"]  # address, stopped, weight 1
    assert churn[12] == "0" and churn[18] == "9001"  # no health: a check must pass first
    assert by_place[("m.churn", "worker-2")][4:9] == ["::1", "0", "0", "0", "0"]  # standby
    grpc = by_place[("g.churn", "worker-1")]
    assert grpc[18] == "9002" and grpc[21] == "0"  # a unary call: to its HTTP port
    stream = by_place[("grpc.stream", "worker-1")]
    assert stream[18] == "9102" and stream[21] == "9002"  # checked on its HTTP port


async def test_a_cli_command_refused_for_a_moment_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bound but not listening, the socket refuses, as the master's does while it executes
    # itself again on a reload; it listens from the third attempt on.
    door = HAProxy(tmp_path, binary="haproxy")
    held = socket.socket(socket.AF_UNIX)
    held.bind(str(door.socket_path))
    attempts: list[str] = []
    servers: list[asyncio.Server] = []
    connect = asyncio.open_unix_connection

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked = await reader.read()
        writer.write(b"asked: " + asked)
        await writer.drain()
        writer.close()

    async def counted(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        attempts.append(path)
        if len(attempts) == 3:
            servers.append(await asyncio.start_unix_server(answer, sock=held))
        return await connect(path)

    monkeypatch.setattr(asyncio, "open_unix_connection", counted)
    try:
        assert await door.command("show proc") == "asked: show proc\n"
        assert len(attempts) == 3
    finally:
        for server in servers:
            server.close()
        held.close()


async def test_a_cli_refusing_past_its_patience_is_the_callers_error(tmp_path: Path) -> None:
    door = HAProxy(tmp_path, binary="haproxy")
    door.cli_patience_s = 0.1
    with socket.socket(socket.AF_UNIX) as never:
        never.bind(str(door.socket_path))
        with pytest.raises(ConnectionRefusedError):
            await door.command("show proc")
