"""Every stop drains: a stop signal repeated within the grace window is the same request, a
later one or SIGQUIT forces (`loops.StopRequests`, with explicit times; `StopSignals` with a
fake clock)."""

from __future__ import annotations

import logging

import pytest

from tailserve.process.loops import STOP_GRACE_S, Stop, StopRequests, StopSignals


def test_a_signal_repeated_within_the_window_is_the_same_request() -> None:
    requests = StopRequests(grace_s=5.0)
    assert requests.signalled(100.0) is Stop.DRAIN
    # As make or a forwarding shell delivers it: again within milliseconds, and again later on.
    assert requests.signalled(100.002) is Stop.SAME
    assert requests.signalled(104.9) is Stop.SAME
    assert requests.signalled(105.0) is Stop.SAME


def test_a_signal_after_the_window_forces_and_the_stop_stays_forced() -> None:
    requests = StopRequests(grace_s=5.0)
    assert requests.signalled(100.0) is Stop.DRAIN
    assert requests.signalled(103.0) is Stop.SAME
    # The window runs from the first signal: repeats within it do not stretch it.
    assert requests.signalled(105.1) is Stop.FORCE
    assert requests.signalled(105.2) is Stop.FORCE


@pytest.mark.parametrize("first", [False, True], ids=["after-a-drain", "first"])
def test_sigquit_forces_at_any_time(first: bool) -> None:
    requests = StopRequests(grace_s=5.0)
    if not first:
        assert requests.signalled(100.0) is Stop.DRAIN
    assert requests.signalled(100.001, forced=True) is Stop.FORCE
    assert requests.signalled(100.002) is Stop.FORCE


def test_the_default_window_covers_a_parent_passing_the_signal_on() -> None:
    requests = StopRequests()
    assert requests.grace_s == STOP_GRACE_S >= 1.0
    assert requests.signalled(0.0) is Stop.DRAIN
    assert requests.signalled(0.5) is Stop.SAME


def test_stop_signals_hand_each_decision_on_and_log_it(caplog: pytest.LogCaptureFixture) -> None:
    now = [10.0]
    acted: list[Stop] = []
    signals = StopSignals(acted.append, forcing="killing the workers", clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="tailserve.process.loops"):
        assert signals.received("SIGTERM") is Stop.DRAIN
        now[0] = 10.003
        assert signals.received("SIGTERM") is Stop.SAME
        now[0] = 16.0
        assert signals.received("SIGINT") is Stop.FORCE
    assert acted == [Stop.DRAIN, Stop.SAME, Stop.FORCE]
    levels = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert levels[1] == (
        logging.INFO,
        "SIGTERM, 0.003 s after the first: the same request to stop (within 5 s)",
    )
    assert levels[2] == (
        logging.WARNING,
        "SIGINT 6.0 s after the first: forcing the stop, killing the workers",
    )
