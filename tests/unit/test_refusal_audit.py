"""The refusal audit: the admitted requests' p99 over the last second against the SLO, and
admission stretching its allowance on that evidence (a false refusal avoided), on a fake clock."""

from __future__ import annotations

import math

import pytest

from tailserve.engine.batching import Item
from tailserve.engine.buckets import Bucket
from tailserve.engine.deadline_batcher import DeadlineBatcher
from tailserve.engine.refusal_audit import RefusalAudit

SLO_S = 0.050
SHORT = Bucket("short", 0)


def answered(audit: RefusalAudit, latencies: list[float], at: float) -> None:
    for latency in latencies:
        audit.on_answer(latency, at)


def test_comfortable_only_with_enough_answers_whose_p99_is_within_half_the_slo() -> None:
    audit = RefusalAudit(SLO_S)
    assert not audit.comfortable(0.0)  # no evidence: the prediction stands
    answered(audit, [0.005] * 10, 0.0)
    assert not audit.comfortable(0.02)  # too few answers yet
    answered(audit, [0.005] * 200, 0.03)
    assert audit.comfortable(0.04)
    assert audit.p99_s(0.04) == pytest.approx(0.005, rel=0.25)
    answered(audit, [0.040] * 5, 0.05)  # over 1% of the answers near the SLO
    assert not audit.comfortable(0.07)


def test_the_verdict_forgets_after_a_second_and_is_cached_for_a_moment() -> None:
    audit = RefusalAudit(SLO_S)
    answered(audit, [0.045] * 100, 0.0)  # late answers: not comfortable
    assert not audit.comfortable(0.0)
    answered(audit, [0.002] * 100, 0.005)
    assert not audit.comfortable(0.008)  # the verdict of 0.0 still holds (cached)
    # A second on, the late answers are out of both half windows.
    answered(audit, [0.002] * 100, 0.6)
    answered(audit, [0.002] * 100, 1.1)
    assert audit.comfortable(1.2)
    assert math.isnan(RefusalAudit(SLO_S).p99_s(0.0))
    idle = RefusalAudit(SLO_S)
    answered(idle, [0.002] * 100, 0.0)
    assert idle.comfortable(0.1) and not idle.comfortable(5.0)  # nothing since: no evidence


def batcher(audit: RefusalAudit | None) -> DeadlineBatcher:
    b = DeadlineBatcher(max_rows=64, instances=1, max_queue=10_000, audit=audit)
    for rows in (1, 64) * 4:
        b.observe(SHORT, rows, 0.0002 + 0.000005 * rows, 0.0)
    return b


@pytest.mark.parametrize("comfortable", [False, True])
def test_admitted_requests_well_within_the_slo_stretch_the_allowance_not_remove_it(
    comfortable: bool,
) -> None:
    audit = RefusalAudit(SLO_S)
    answered(audit, [0.005 if comfortable else 0.045] * 100, 0.0)
    b = batcher(audit)
    # A burst read after the CPU was away: the loop's backlog predicts 60 ms, more than the
    # whole 50 ms budget.
    b.loop_backlog_s = 0.060
    shed = b.shed(0.0, [0.0], deadline=SLO_S, priority=1)
    offered = b.offer(Item(1, SHORT, 0.0, SLO_S), 0.0, [0.0])
    assert (shed is None) is comfortable and (offered is None) is comfortable
    # An overload's backlog grows past any stretch: refused, evidence or not.
    b.loop_backlog_s = 0.5
    assert b.shed(0.0, [0.0], deadline=SLO_S, priority=1) is not None


def test_a_refusal_made_while_comfortable_leaves_the_share_whole() -> None:
    audit = RefusalAudit(SLO_S)
    answered(audit, [0.005] * 100, 0.0)
    b = batcher(audit)
    b.loop_backlog_s = 0.5
    for _ in range(300):
        assert b.shed(0.0, [0.0], deadline=SLO_S, priority=1) is not None
    assert b.share() == 1.0  # the refusals were judged false: the share did not fall
    plain = batcher(None)
    plain.loop_backlog_s = 0.5
    for _ in range(300):
        assert plain.shed(0.0, [0.0], deadline=SLO_S, priority=1) is not None
    assert plain.share() < 1.0


def test_with_the_event_loop_saturated_no_refusal_is_needless() -> None:
    # Under overload admission keeps the admitted requests quick; the requests waiting in the
    # kernel for the saturated loop are what the refusals are for.
    audit = RefusalAudit(SLO_S)
    answered(audit, [0.005] * 100, 0.0)
    assert audit.needless(0.0, loop_busy=0.5)
    assert not audit.needless(0.0, loop_busy=0.95)
    b = batcher(audit)
    b.loop_busy = 0.95
    b.loop_backlog_s = 0.060
    assert b.shed(0.0, [0.0], deadline=SLO_S, priority=1) is not None
