"""The admin routes of a real worker: closed beyond loopback without a token (403, and one
WARNING at start), the bearer token wherever one is set, open on loopback without one."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from support.models import doubler_config, write_model
from support.servers import run_worker
from tailserve.settings import Settings

# Every admin route, with a body it would take.
ADMIN = [
    ("/v2/repository/index", {}),
    ("/v2/repository/models/m/unload", {}),
    ("/v2/repository/models/m/load", {}),
    ("/v2/cache/invalidate", {"model": "m"}),
]
INFER = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    write_model(tmp_path, "m", doubler_config(cache={"enabled": True}))
    return tmp_path


def test_beyond_loopback_without_a_token_the_admin_routes_are_closed(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    with run_worker(Settings(repository=str(repository)), host="0.0.0.0") as running:
        for path, payload in ADMIN:
            for headers in ({}, {"Authorization": "Bearer anything"}):
                reply = httpx.post(f"{running.url}{path}", json=payload, headers=headers)
                assert reply.status_code == 403, path
                message = reply.json()["error"]
                assert "need a token" in message and "beyond loopback" in message
                assert "--admin-token" in message and "TAILSERVE_ADMIN_TOKEN" in message
        # The unload was refused: the model still serves, and so do the other routes.
        assert httpx.get(f"{running.url}/v2/health/ready").status_code == 200
        assert httpx.post(f"{running.url}/v2/models/m/infer", json=INFER).status_code == 200
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "admin routes closed" in warnings[0].getMessage()
    assert "--admin-token" in warnings[0].getMessage()


def test_beyond_loopback_a_token_opens_the_admin_routes(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(repository=str(repository), admin_token="s3cret")
    with run_worker(settings, host="0.0.0.0") as running:
        url = f"{running.url}/v2/repository/index"
        assert httpx.post(url).status_code == 401
        assert httpx.post(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        reply = httpx.post(url, headers={"Authorization": "Bearer s3cret"})
        assert reply.status_code == 200
        assert reply.json() == [{"name": "m", "version": "1", "state": "READY"}]
    assert not [r for r in caplog.records if "admin routes closed" in r.getMessage()]


def test_on_loopback_without_a_token_the_admin_routes_stay_open(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with run_worker(Settings(repository=str(repository))) as running:
        for path, payload in ADMIN:
            assert httpx.post(f"{running.url}{path}", json=payload).status_code == 200, path
    assert not [r for r in caplog.records if "admin routes closed" in r.getMessage()]
