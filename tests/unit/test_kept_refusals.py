"""The refusals the data plane keeps for a moment: which requests a kept one answers, and when
the model is asked again."""

from __future__ import annotations

import pytest

from tailserve.engine.kept_refusals import MAX_KEPT, KeptRefusals
from tailserve.errors import DeadlineUnmeetable


class Model:
    """A model's shed on a fake clock: refuses while ``busy``, each refusal reusable for
    ``moment_s`` when ``reusable``, letting through budgets of ``least_s`` or more."""

    def __init__(self) -> None:
        self.now = 100.0
        self.busy = True
        self.reusable = True
        self.moment_s = 0.05
        self.least_s = 0.2
        self.asked: list[tuple[str, float | None]] = []
        self.counted: list[str] = []

    def shed(
        self, name: str, version: str | None, *, received_at: float, deadline_ms: float | None
    ) -> None:
        self.asked.append((name, deadline_ms))
        if self.busy:
            budget = (deadline_ms or 100.0) / 1e3
            raise DeadlineUnmeetable(
                f"{name} is too busy",
                deadline=received_at + budget,
                least_budget_s=self.least_s,
                reusable_until=self.now + self.moment_s if self.reusable else 0.0,
            )

    def refused(self, name: str, version: str | None) -> None:
        self.counted.append(name)

    def memo(self) -> KeptRefusals:
        return KeptRefusals(self.shed, self.refused, clock=lambda: self.now)


def test_a_like_request_with_less_time_left_gets_the_kept_refusal_and_is_counted() -> None:
    model = Model()
    memo = model.memo()
    first = memo.screen("churn", None, received_at=model.now, deadline_ms=100.0)
    assert first is not None and "too busy" in str(first.error)
    model.now += 0.01  # the next one arrived later: less of the same budget is left
    again = memo.screen("churn", None, received_at=model.now - 0.001, deadline_ms=100.0)
    assert again is first
    assert model.asked == [("churn", 100.0)] and model.counted == ["churn"]


def test_the_kept_refusal_keeps_the_adapters_reply() -> None:
    model = Model()
    memo = model.memo()
    first = memo.screen("churn", None, received_at=model.now, deadline_ms=None)
    assert first is not None
    first.reply = "rendered once"
    again = memo.screen("churn", None, received_at=model.now, deadline_ms=None)
    assert again is not None and again.reply == "rendered once"


def test_a_request_with_more_time_than_the_least_let_through_asks_the_model() -> None:
    model = Model()
    memo = model.memo()
    memo.screen("churn", None, received_at=model.now, deadline_ms=100.0)
    model.busy = False
    # 500 ms left: more than the 200 ms the model would let through, so it is asked.
    assert memo.screen("churn", None, received_at=model.now, deadline_ms=500.0) is None
    assert model.asked == [("churn", 100.0), ("churn", 500.0)] and model.counted == []


def test_each_kind_is_its_own_and_the_moment_passes() -> None:
    model = Model()
    memo = model.memo()
    memo.screen("churn", None, received_at=model.now, deadline_ms=100.0)
    # Another model, version or deadline header is another kind.
    memo.screen("sentiment", None, received_at=model.now, deadline_ms=100.0)
    memo.screen("churn", "2", received_at=model.now, deadline_ms=100.0)
    memo.screen("churn", None, received_at=model.now, deadline_ms=50.0)
    assert len(model.asked) == 4 and len(memo) == 4
    model.now += model.moment_s  # the moment is over: the model is asked again
    model.busy = False
    assert memo.screen("churn", None, received_at=model.now, deadline_ms=100.0) is None
    assert len(model.asked) == 5 and len(memo) == 3


def test_a_refusal_for_this_request_alone_is_raised_and_not_kept() -> None:
    model = Model()
    model.reusable = False
    memo = model.memo()
    for _ in range(2):
        with pytest.raises(DeadlineUnmeetable, match="too busy"):
            memo.screen("churn", None, received_at=model.now, deadline_ms=100.0)
    assert len(model.asked) == 2 and len(memo) == 0


def test_the_memo_is_emptied_when_clients_vary_the_header_past_its_size() -> None:
    model = Model()
    memo = model.memo()
    for deadline in range(MAX_KEPT):
        memo.screen("churn", None, received_at=model.now, deadline_ms=float(deadline + 1))
    assert len(memo) == MAX_KEPT
    memo.screen("churn", None, received_at=model.now, deadline_ms=1e6)
    assert len(memo) == 1
