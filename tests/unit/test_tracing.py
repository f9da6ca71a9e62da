"""Tracing's pure parts: trace headers in a framed request, the W3C traceparent, and each
refusal's reason."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tailserve.assembly.child_commands import lane_command, worker_command
from tailserve.assembly.up import add_parser, fleet_config
from tailserve.errors import (
    ConfigError,
    DeadlineExceeded,
    DeadlineUnmeetable,
    InvalidInput,
    ModelNotReady,
    Overloaded,
    QueueFull,
    Unavailable,
)
from tailserve.fleet.processes import ManagedWorker
from tailserve.observability.tracing import parse_traceparent, start_tracing
from tailserve.protocols.refusals import refusal_reason
from tailserve.router.attempt_spans import with_headers
from tailserve.transport.http1 import frame_request


def test_trace_headers_replace_the_incoming_ones() -> None:
    data = frame_request(
        "POST", "/v2/models/m/infer", "w", b"{}", [("traceparent", "00-old"), ("x-a", "1")]
    )
    out = with_headers(data, {"traceparent": "00-new"})
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v2/models/m/infer HTTP/1.1"
    assert b"traceparent: 00-new" in lines and b"traceparent: 00-old" not in lines
    assert b"x-a: 1" in lines and body == b"{}"
    assert with_headers(data, {}) == data


def test_traceparent_parsing() -> None:
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert parse_traceparent(good) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", True)
    assert parse_traceparent(good[:-1] + "0")[2] is False  # type: ignore[index]
    for bad in ("", "00-xyz-b7ad6b7169203331-01", "00-" + "0" * 32 + "-b7ad6b7169203331-01"):
        assert parse_traceparent(bad) is None


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (QueueFull("q"), "queue_full"),
        (Overloaded("q"), "queue_full"),
        (DeadlineUnmeetable("d"), "deadline_unmeetable"),
        (DeadlineExceeded("d"), "deadline_exceeded"),
        (ModelNotReady("n"), "not_ready"),
        (Unavailable("u"), "unavailable"),
        (InvalidInput("i"), None),
    ],
)
def test_refusal_reasons(error: Exception, reason: str | None) -> None:
    assert refusal_reason(error) == reason  # type: ignore[arg-type]


def test_tracing_is_off_without_an_endpoint() -> None:
    assert start_tracing("tailserve-worker") is None
    assert start_tracing("tailserve-worker", env={"OTHER": "x"}) is None
    on = start_tracing(
        "tailserve-worker", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    )
    assert on is not None
    on.shutdown()


def test_up_passes_the_trace_options_to_its_workers_and_lane(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    flags = ["--otel-endpoint", "http://collector:4318", "--otel-sample", "0.5"]
    args = parser.parse_args(["up", "--repository", str(tmp_path), *flags])
    config = fleet_config(args, {})
    worker = worker_command(config, ManagedWorker("worker-0", 1, 2))
    lane = lane_command(config, ManagedWorker("lane", 3), tmp_path / "backends")
    for command in (worker, lane):
        at = command.index("--otel-endpoint")
        assert command[at : at + 4] == flags, command
    quiet = parser.parse_args(["up", "--repository", str(tmp_path)])
    assert "--otel-endpoint" not in lane_command(
        fleet_config(quiet, {}), ManagedWorker("lane", 3), tmp_path / "backends"
    )
    wrong = parser.parse_args(["up", "--repository", str(tmp_path), "--otel-sample", "2"])
    with pytest.raises(ConfigError, match=r"--otel-sample must be between 0 and 1, not 2\.0"):
        fleet_config(wrong, {})
