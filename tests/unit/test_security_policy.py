"""Security policy, without a network: how client values appear in errors, that no token is
compared with ``==``, what a Redis URL carries (password, TLS files) and what it shows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from redis.asyncio import Redis

import tailserve
from tailserve.cache.redis import connect, redacted, secured_url, without_password
from tailserve.engine.messages import InferRequest
from tailserve.errors import ConfigError, InvalidInput, shown
from tailserve.protocols.http.headers import read_options, request_options
from tailserve.settings import load_settings
from tailserve.transport.request import HttpRequest

SOURCE = Path(tailserve.__file__).parent


def _options(*headers: tuple[bytes, bytes]) -> InferRequest:
    request = HttpRequest(
        "POST", b"/v2/models/m/infer", list(headers), b"", received_at=0.0, max_body_bytes=1
    )
    infer = InferRequest(model="m", inputs=[])
    request_options(request, infer, read_options(request))
    return infer


# --- errors never echo raw bytes -------------------------------------------------------------


def test_shown_decodes_bytes_escapes_control_characters_and_cuts_long_values() -> None:
    assert shown(b"abc") == "'abc'"
    assert shown(b"\xff\x00x") == "'\ufffd\\x00x'"
    assert shown("line\r\nbreak") == "'line\\r\\nbreak'"
    assert shown(5) == "'5'"
    long = shown(b"9" * 10_000)
    assert long == "'" + "9" * 64 + "' (cut to 64 characters)"


@pytest.mark.parametrize(
    ("header", "value", "expected"),
    [
        (b"x-deadline-ms", b"abc", "X-Deadline-Ms must be a positive number of milliseconds"),
        (b"x-deadline-ms", b"-3", "got '-3'"),
        (b"x-deadline-ms", b"\xfe\xff" * 300, "(cut to 64 characters)"),
        (b"x-priority", b"high", "X-Priority must be a whole number: 1 is the highest level"),
        (b"x-priority", b"\x01", "got '\\x01'"),
    ],
)
def test_bad_option_headers_say_what_is_expected_without_raw_bytes(
    header: bytes, value: bytes, expected: str
) -> None:
    with pytest.raises(InvalidInput) as caught:
        _options((header, value))
    message = caught.value.message
    assert expected in message
    assert "b'" not in message and 'b"' not in message


def test_a_negative_priority_header_is_a_whole_number_left_to_the_range_check() -> None:
    # "-5" is a whole number: refused by the model's range (engine.options), not as "not whole".
    assert _options((b"x-priority", b"-5")).priority == -5
    assert _options((b"x-priority", b"2"), (b"x-deadline-ms", b"2.5")).deadline_ms == 2.5


# --- admin tokens: constant time -------------------------------------------------------------


def _token_comparisons(tree: ast.AST) -> list[int]:
    """Lines of ``==``/``!=`` comparisons where a side names a token, a secret or the
    Authorization header."""

    def secret(node: ast.expr) -> bool:
        text = ast.unparse(node).lower()
        return any(word in text for word in ("token", "authorization", "secret", "_admin"))

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Eq | ast.NotEq) for op in node.ops
        ):
            sides = [node.left, *node.comparators]
            # `token is None`-style checks are `is`; a comparison with a constant string is a
            # parse (a header name, "Bearer"), not a check of a secret.
            if any(secret(side) for side in sides) and not any(
                isinstance(side, ast.Constant) for side in sides
            ):
                lines.append(node.lineno)
    return lines


def test_no_token_is_compared_with_equality_anywhere_in_the_source() -> None:
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        lines = _token_comparisons(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[str(path.relative_to(SOURCE))] = lines
    assert found == {}


def test_the_one_token_check_uses_a_constant_time_comparison() -> None:
    # Every process that checks a token is a worker (the router, the fleet's admin lane and the
    # gRPC service pass the header on or have no admin routes): its HTTP application.
    checks = [
        path.relative_to(SOURCE).as_posix()
        for path in SOURCE.rglob("*.py")
        if "hmac.compare_digest" in path.read_text(encoding="utf-8")
    ]
    assert checks == ["protocols/http/app.py"]
    app = (SOURCE / "protocols/http/app.py").read_text(encoding="utf-8")
    assert 'request.header(b"authorization")' in app
    assert "compare_digest(given, self._admin)" in app


def test_the_comparison_scan_finds_an_equality_check() -> None:
    tree = ast.parse("if given == self._admin_token:\n    pass\nif name == 'x':\n    pass\n")
    assert _token_comparisons(tree) == [1]


# --- Redis: AUTH and TLS options -------------------------------------------------------------


def test_a_password_given_apart_from_the_url_goes_into_it_quoted(tmp_path: Path) -> None:
    assert secured_url("redis://cache:6379/2", password="p@ss:w/rd") == (
        "redis://:p%40ss%3Aw%2Frd@cache:6379/2"
    )
    assert secured_url("redis://u:old@cache:6379", password="new") == "redis://u:new@cache:6379"
    secret = tmp_path / "redis.pass"
    secret.write_text("from-file\n", encoding="utf-8")
    assert secured_url("redis://cache", password_file=str(secret)) == "redis://:from-file@cache"
    # The environment's (or the setting's) password wins over the file's.
    assert secured_url("redis://cache", password="env", password_file=str(secret)) == (
        "redis://:env@cache"
    )
    assert secured_url("redis://:kept@cache") == "redis://:kept@cache"


def test_an_unreadable_password_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the Redis password file .*missing"):
        secured_url("redis://cache", password_file=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match="it is empty"):
        secured_url("redis://cache", password_file=str(empty))


def test_tls_files_reach_redis_py_connection_options(tmp_path: Path) -> None:
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("-", encoding="utf-8")
    url = secured_url(
        "rediss://:pw@cache:6380/0",
        ca_file=str(files["ca"]),
        cert_file=str(files["cert"]),
        key_file=str(files["key"]),
    )
    client = connect(url)
    assert isinstance(client, Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == str(files["ca"])
    assert kwargs["ssl_certfile"] == str(files["cert"])
    assert kwargs["ssl_keyfile"] == str(files["key"])
    assert kwargs["password"] == "pw"
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"


def test_tls_files_need_a_rediss_url_and_must_exist(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-", encoding="utf-8")
    with pytest.raises(ConfigError, match="TLS files are for a rediss:// URL"):
        secured_url("redis://:secret@cache", ca_file=str(ca))
    with pytest.raises(ConfigError, match=r"Redis TLS file .*nope\.pem not found"):
        secured_url("rediss://cache", ca_file=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError) as caught:
        secured_url("redis://:secret@cache", ca_file=str(ca))
    assert "secret" not in caught.value.message


def test_a_url_shown_or_passed_on_never_carries_its_password() -> None:
    assert redacted("redis://:s3cret@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted("rediss://user:s3cret@cache") == "rediss://user:***@cache"
    assert without_password("redis://u:s%40cret@cache:1/0") == ("redis://u@cache:1/0", "s@cret")
    assert without_password("redis://cache") == ("redis://cache", None)


def test_the_redis_password_is_read_from_the_environment() -> None:
    settings = load_settings(env={"TAILSERVE_REDIS_PASSWORD": "from-env"})
    assert settings.redis_password == "from-env"


# --- no secrets in the request trace ---------------------------------------------------------


def test_the_trace_recorder_keeps_no_authorization_header(tmp_path: Path) -> None:
    from tailserve.observability.trace_log import TraceRecorder

    path = tmp_path / "trace.jsonl"
    recorder = TraceRecorder(path)
    headers = [(b"authorization", b"Bearer t0ken-5ecret"), (b"x-deadline-ms", b"50")]
    recorder.record("POST", "/v2/models/m/infer", headers, b"{}")
    recorder.close()
    text = path.read_text(encoding="utf-8")
    assert '"x-deadline-ms":"50"' in text
    assert "5ecret" not in text and "authorization" not in text.lower()
