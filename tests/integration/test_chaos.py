"""The chaos suite's quick part (`make chaos` runs the whole, benchmarks/chaos.py): a real
stack under 100 requests a second through the client library while a worker is killed, Redis
restarted, a worker stopped for 2 s and the front door killed. Every request is answered (a
retry can serve each of them), and each fault is over within a few seconds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.chaos import ChaosPlan, chaos_stack, churn_repository, run_chaos

# (Run alone, the session's example repository is trained first: a minute on a busy machine.)
pytestmark = pytest.mark.timeout(240)

# Requests held by a stopped worker wait out its 2 s; a second is good again once its p99 is
# back under half a second (the SLO itself is for the whole suite on a quiet machine: a loaded
# 2-core machine misses it now and then with no fault at all).
PLAN = ChaosPlan(
    rate=100.0,
    warmup_s=2.0,
    baseline_s=3.0,
    quiet_s=4.0,
    kills=1,
    stop_s=2.0,
    redis_down_s=2.0,
    lost_after_s=10.0,
    bar_s=0.5,
)


async def test_no_request_fails_or_is_lost_under_chaos(
    example_repository: Path, tmp_path: Path
) -> None:
    repository = churn_repository(example_repository, tmp_path / "repository")
    with chaos_stack(repository, tmp_path) as stack:
        result = await run_chaos(stack, PLAN, echo=lambda _: None)
        log = stack.up.log()
    # The front door is started again at once (the workers wait 0.5 s).
    assert re.search(r"the front door \(pid \d+\) exited with -9: restarting it in 0\.1 s", log)
    table = result.table()
    assert [row.fault for row in result.rows] == list(PLAN.faults), table
    for row in result.rows:
        assert row.sent >= PLAN.rate * PLAN.quiet_s * 0.9, table
        assert (row.failed, row.lost) == (0, 0), f"{row.fault}: {row.why}\n{table}"
        # (Recovery counts from the blow: the stop's 2 s, the front door's restart. A worker
        # resumed after its stop answers what it held and the clients' retries at once: on a
        # busy 2-core machine its p99 has taken up to 4 s more to be back under the bar.)
        assert row.recover_s is not None and row.recover_s <= PLAN.stop_s + 4.0, (
            f"{row.fault}: {row.seconds}\n{table}"
        )
