"""The router's pure edges: which pool a path goes to, cost classes, affinity keys, framing
with the deadline left, membership sources (file and DNS, with a fake resolver), settings."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from tailserve.errors import ConfigError
from tailserve.protocols.http.app import SlowFault
from tailserve.router.config import RouterConfig, parse_backend, parse_model_balance
from tailserve.router.hedging import HedgeBudget
from tailserve.router.keys import body_key, cost_class
from tailserve.router.membership import Membership, parse_members, write_members
from tailserve.router.router_app import classify, framer
from tailserve.router.upstreams import ANY
from tailserve.transport.request import HttpRequest


@pytest.mark.parametrize(
    ("method", "path", "model", "infer", "broadcast"),
    [
        ("POST", "/v2/models/churn/infer", "churn", True, False),
        ("POST", "/v2/models/churn/versions/2/infer", "churn", True, False),
        ("GET", "/v2/models/churn", "churn", False, False),
        ("GET", "/v2/models/churn/ready", "churn", False, False),
        ("GET", "/v2/models/stats", ANY, False, False),
        ("POST", "/v1/models/churn:predict", "churn", True, False),
        ("GET", "/v1/models/churn", "churn", False, False),
        ("POST", "/v2/repository/models/churn/load", "churn", False, True),
        ("POST", "/v2/repository/index", ANY, False, False),
        ("GET", "/v2", ANY, False, False),
        ("GET", "/no/such/path", ANY, False, False),
    ],
)
def test_classify(method: str, path: str, model: str, infer: bool, broadcast: bool) -> None:
    target = classify(method, path)
    assert (target.model, target.infer, target.broadcast) == (model, infer, broadcast)


def test_cost_classes_grow_with_the_body() -> None:
    assert [cost_class(n) for n in (0, 4095, 4096, 65535, 65536, 10**7)] == [
        "s",
        "s",
        "m",
        "m",
        "l",
        "l",
    ]


def test_body_keys_are_equal_for_equal_bodies_only() -> None:
    assert body_key(b'{"a":1}') == body_key(b'{"a":1}')
    assert body_key(b'{"a":1}') != body_key(b'{"a":2}')
    assert body_key(b"not json") == body_key(b"not json") != body_key(b"not json!")


def _infer_body(x: float, **extra: object) -> bytes:
    document = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}]}
    return orjson.dumps({**document, **extra})


def test_a_body_key_follows_the_inputs_not_the_id_or_options() -> None:
    plain = body_key(_infer_body(1.5))
    assert body_key(_infer_body(1.5, id="r-7", parameters={"priority": 1})) == plain
    assert body_key(_infer_body(2.5)) != plain
    # Key order inside the tensor does not matter either.
    reordered = b'{"inputs":[{"data":[1.5],"shape":[1,1],"datatype":"FP32","name":"x"}]}'
    assert body_key(reordered) == plain


def test_an_affinity_key_parameter_is_the_key() -> None:
    assert body_key(_infer_body(1.5, parameters={"affinity_key": "user-42"})) == "user-42"
    assert body_key(_infer_body(9.0, parameters={"affinity_key": 42})) == "42"
    assert body_key(_infer_body(1.5, parameters={"affinity_key": True})) == body_key(
        _infer_body(1.5)
    )


def test_binary_bodies_key_on_their_header_inputs_and_their_data() -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": 4},
                }
            ]
        }
    )
    one, two = header + b"\x00\x00\xc0?", header + b"\x00\x00 @"
    assert body_key(one, len(header)) == body_key(one, len(header))
    assert body_key(one, len(header)) != body_key(two, len(header))


def _request(
    headers: list[tuple[bytes, bytes]], body: bytes = b"{}", method: str = "POST"
) -> HttpRequest:
    return HttpRequest(
        method, b"/v2/models/m/infer?x=1", headers, body, received_at=0.0, max_body_bytes=1 << 20
    )


def test_framing_drops_hop_headers_and_writes_the_deadline_left() -> None:
    request = _request(
        [
            (b"host", b"router"),
            (b"connection", b"keep-alive"),
            (b"x-deadline-ms", b"100"),
            (b"transfer-encoding", b"chunked"),
            (b"x-request-id", b"abc"),
        ]
    )
    frame = framer(request)
    data = frame(0.0425)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v2/models/m/infer?x=1 HTTP/1.1"
    assert b"x-request-id: abc" in lines and b"host: router" in lines
    assert b"x-deadline-ms: 42.500" in lines
    assert not any(line.startswith((b"connection", b"transfer-encoding")) for line in lines)
    assert b"content-length: 2" in lines and body == b"{}"
    # Without a deadline of its own, the request carries none.
    assert b"x-deadline-ms" not in framer(_request([]))(None)


def test_a_head_request_goes_upstream_as_a_get_with_its_target_as_sent() -> None:
    request = HttpRequest(
        "HEAD",
        b"/v2/models/a%2Fb?verbose=1",
        [(b"host", b"r")],
        b"",
        received_at=0.0,
        max_body_bytes=0,
    )
    head = framer(request)(None)
    assert head == b"GET /v2/models/a%2Fb?verbose=1 HTTP/1.1\r\nhost: r\r\n\r\n"
    assert classify(request.method, "/v2/models/a%2Fb").model == "a/b"


def test_a_deadline_that_is_not_a_number_reaches_the_worker_as_sent() -> None:
    frame = framer(_request([(b"x-deadline-ms", b"soon")]))
    assert b"x-deadline-ms: soon" in frame(None)


def test_members_file_lines_and_their_problems() -> None:
    urls, problems = parse_members(
        "# workers\nhttp://10.0.0.1:8000\n10.0.0.2:8000  # second\n\nftp://x:1\nnoport\n"
        "10.0.0.5:abc\n10.0.0.6:99999\n"
    )
    assert urls == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    # A port that is no number, or past 65535, is a problem of its line like any other (it
    # used to raise out of the parser and stop the file's watcher for good).
    assert [p.split(":")[0] for p in problems] == [f"backends file line {n}" for n in (5, 6, 7, 8)]


async def test_membership_unites_flags_file_and_dns(tmp_path: Path) -> None:
    members = tmp_path / "backends"
    write_members(members, ["http://10.0.0.9:8000"])
    answers = {"workers.svc": ["10.1.0.1", "10.1.0.2"]}
    applied: list[list[str]] = []
    config = RouterConfig(
        backends=("127.0.0.1:9000",), backends_file=str(members), backends_dns="workers.svc:8000"
    )
    membership = Membership(config, applied.append, resolve=lambda host, port: list(answers[host]))
    assert await membership.refresh() == [
        "http://127.0.0.1:9000",
        "http://10.0.0.9:8000",
        "http://10.1.0.1:8000",
        "http://10.1.0.2:8000",
    ]
    # A pod goes away; the file is unreadable for a moment: the file keeps its last answer.
    answers["workers.svc"] = ["10.1.0.2"]
    members.unlink()
    await membership.refresh()
    assert applied[-1] == ["http://127.0.0.1:9000", "http://10.0.0.9:8000", "http://10.1.0.2:8000"]
    # Nothing changed: nothing applied again.
    count = len(applied)
    await membership.refresh()
    assert len(applied) == count


async def test_a_name_that_stops_resolving_keeps_its_last_backends() -> None:
    answers: dict[str, list[str]] = {"svc": ["10.2.0.1"]}

    def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("no such name")
        return answers[host]

    membership = Membership(RouterConfig(backends_dns="svc:80"), lambda urls: None, resolve=resolve)
    assert await membership.refresh() == ["http://10.2.0.1:80"]
    answers.clear()
    assert await membership.refresh() == ["http://10.2.0.1:80"]


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown balancing policy 'fastest'"):
        RouterConfig(balance="fastest")
    with pytest.raises(ConfigError, match="not http://HOST:PORT"):
        RouterConfig(backends=("http://no-port",))
    with pytest.raises(ConfigError, match="has a path"):
        parse_backend("http://h:1/v2")
    with pytest.raises(ConfigError, match="MODEL=POLICY"):
        parse_model_balance(["churn"])
    config = RouterConfig(model_balance=parse_model_balance(["churn=affinity"]))
    assert config.policy_of("churn") == "affinity" and config.policy_of("other") == "p2c"


def test_a_refund_gives_back_a_spent_token() -> None:
    budget = HedgeBudget(ratio=1.0)
    budget.earn()
    assert budget.try_spend() and not budget.try_spend()
    budget.refund()
    assert budget.spent == 0 and budget.try_spend()


async def test_the_slow_fault_slows_the_chosen_fraction_by_its_factor() -> None:
    import random

    never, always = SlowFault(0.0, 20.0), SlowFault(1.0, 3.0, random.Random(1))
    loop = asyncio.get_running_loop()
    started = loop.time()
    await never.delay(1.0)
    assert loop.time() - started < 0.5
    started = loop.time()
    await always.delay(0.02)  # (3 - 1) x 20 ms
    assert loop.time() - started >= 0.039
    with pytest.raises(ValueError):
        SlowFault(1.5, 2.0)
