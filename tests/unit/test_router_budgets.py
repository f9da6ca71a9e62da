"""The dispatcher's budgets: the queue of hedges waiting for a token (who gets the next one),
and the retry burst."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import cast

import pytest

from tailserve.router.config import RouterConfig
from tailserve.router.dispatch import Dispatcher
from tailserve.router.exchange import Exchange


class Waiting:
    """A request whose hedge waits for a token (what the queue asks of an `Exchange`)."""

    def __init__(self, name: str, sent: list[str], *, overdue: bool) -> None:
        self.name = name
        self.sent = sent
        self.overdue = overdue
        self.answered = False

    def awaits_hedge(self, now: float) -> bool:
        return not self.answered

    def may_hedge_late(self, now: float) -> bool:
        return self.overdue

    def send_hedge(self, *, late: bool = False) -> None:
        assert late
        self.sent.append(self.name)


@pytest.fixture
def dispatcher() -> Iterator[Dispatcher]:
    loop = asyncio.new_event_loop()
    try:
        yield Dispatcher(RouterConfig(balance="p2c"), loop=loop)
    finally:
        loop.close()


def queue(d: Dispatcher, waiting: Waiting, *, suspect: bool) -> None:
    d.defer_hedge(cast(Exchange, waiting), None, suspect=suspect)


def earn(d: Dispatcher, tokens: int) -> None:
    for _ in range(round(tokens / d.hedge_budget.ratio)):
        d.hedge_budget.earn()


def test_a_request_on_a_suspect_replica_takes_the_next_token_before_older_ones(
    dispatcher: Dispatcher,
) -> None:
    sent: list[str] = []
    healthy = Waiting("healthy tail", sent, overdue=True)
    stuck = Waiting("stuck", sent, overdue=False)
    queue(dispatcher, healthy, suspect=False)
    queue(dispatcher, stuck, suspect=True)
    assert dispatcher.hedges_waiting == 2
    dispatcher.release_hedges(0.0)
    assert sent == []  # no token yet
    earn(dispatcher, 1)
    dispatcher.release_hedges(0.0)
    # The stuck one goes first, not yet overdue: its replica keeps losing to hedges.
    assert sent == ["stuck"]
    earn(dispatcher, 1)
    dispatcher.release_hedges(0.0)
    assert sent == ["stuck", "healthy tail"]
    assert dispatcher.hedges_waiting == 0 and dispatcher.hedge_budget.spent == 2


def test_the_others_still_wait_to_be_overdue_and_answered_ones_leave(
    dispatcher: Dispatcher,
) -> None:
    sent: list[str] = []
    answered = Waiting("answered", sent, overdue=True)
    early = Waiting("not overdue", sent, overdue=False)
    queue(dispatcher, answered, suspect=True)
    queue(dispatcher, early, suspect=False)
    answered.answered = True
    earn(dispatcher, 2)
    dispatcher.release_hedges(0.0)
    assert sent == [] and dispatcher.hedges_waiting == 1
    early.overdue = True
    dispatcher.release_hedges(0.0)
    assert sent == ["not overdue"] and dispatcher.hedge_budget.spent == 1


def test_the_retry_burst_covers_a_full_backends_requests_in_flight() -> None:
    # A worker killed with its in-flight limit reached fails that many requests at once.
    loop = asyncio.new_event_loop()
    try:
        for limit, burst in ((64, 64.0), (8, 20.0)):
            d = Dispatcher(RouterConfig(max_in_flight=limit), loop=loop)
            assert d.retry_budget.cap == burst and d.retry_budget.tokens == burst
    finally:
        loop.close()
