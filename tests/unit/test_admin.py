"""Who may call the admin routes: open on loopback, the bearer token wherever one is set,
closed beyond loopback without one."""

from __future__ import annotations

import pytest

from tailserve.transport.admin_access import AdminAccess, admin_access, is_loopback

LOOPBACK = ["127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.1"]
BEYOND = [
    "0.0.0.0",
    "::",
    "",
    "192.168.1.20",
    "10.0.0.5",
    "fe80::1",
    "::ffff:10.0.0.5",
    "worker-3.internal",
]


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_without_a_token_stays_open(host: str) -> None:
    assert is_loopback(host)
    assert admin_access(host, None) is AdminAccess.OPEN
    assert admin_access(host, "") is AdminAccess.OPEN  # an empty token is no token


@pytest.mark.parametrize("host", BEYOND)
def test_beyond_loopback_without_a_token_is_closed(host: str) -> None:
    assert not is_loopback(host)
    assert admin_access(host, None) is AdminAccess.CLOSED
    assert admin_access(host, "") is AdminAccess.CLOSED


@pytest.mark.parametrize("host", [*LOOPBACK, *BEYOND])
def test_a_token_is_checked_wherever_the_worker_listens(host: str) -> None:
    assert admin_access(host, "s3cret") is AdminAccess.TOKEN
