"""What one attempt's result says, to the backend's pool and to the request.

A result is the reply's status code or the `UpstreamError` that came instead. To the pool
(`report`): a 429 is a refusal (the worker is full, not broken); a 503, or a timeout that is no
evidence against the backend (`timeout_tells`), is inconclusive; a failed or lost connection is
a connect failure; anything else is a reply, ok below 500. To the request (`may_retry`): it may
be tried once more, on another replica, when that is safe and the retry budget has a token.

Pure: no I/O; times and budgets are passed in.
"""

from __future__ import annotations

import statistics

from tailserve.errors import ConnectFailed, ConnectionLost, UpstreamError
from tailserve.router.backends import Backend, Pool
from tailserve.router.hedging import RetryBudget

# A timeout on a request's own deadline counts against the backend only once it had this many
# times its usual reply time (see timeout_tells).
TIMEOUT_EVIDENCE = 4.0

# A reply's status code, or why no reply came.
Result = int | UpstreamError


def is_timeout(error: UpstreamError) -> bool:
    return not isinstance(error, ConnectFailed | ConnectionLost)


def timeout_tells(backend: Backend, pool: Pool, latency_s: float, *, has_deadline: bool) -> bool:
    """Whether a timeout (the router's, or a worker's 504) after ``latency_s`` is evidence
    against the backend: always on the router's own request timeout; on the request's
    deadline, only once the backend had four times its usual reply time (the average of
    its successful replies, or the pool's median while it has none). A deadline shorter
    than any replica answers in says nothing of the one that had the request."""
    if not has_deadline:
        return True
    usual = backend.usual_s
    if usual is None:
        known = [b.usual_s for b in pool if b.usual_s is not None]
        if not known:
            return False
        usual = statistics.median(known)
    return latency_s >= TIMEOUT_EVIDENCE * usual


def report(
    pool: Pool,
    backend: Backend,
    result: Result,
    latency_s: float,
    now: float,
    *,
    has_deadline: bool,
) -> str:
    """Tell ``pool`` how ``backend`` did on one attempt; answers the attempt's label in the
    attempts metric (its status code, ``connect_failed`` or ``timeout``)."""
    if isinstance(result, int):
        if result == 429:
            pool.refused(backend, latency_s, now=now)
        elif result == 503 or (
            result == 504 and not timeout_tells(backend, pool, latency_s, has_deadline=has_deadline)
        ):
            pool.inconclusive(backend, latency_s, now=now)
        else:
            pool.finish(backend, latency_s, ok=result < 500, now=now)
        return str(result)
    if isinstance(result, ConnectFailed | ConnectionLost):
        pool.connect_failed(backend, now=now)
        return "connect_failed"
    if timeout_tells(backend, pool, latency_s, has_deadline=has_deadline):
        pool.finish(backend, latency_s, ok=False, now=now)
    else:
        pool.inconclusive(backend, latency_s, now=now)
    return "timeout"


def may_retry(
    result: Result,
    *,
    idempotent: bool,
    retried: bool,
    remaining_s: float,
    budget: RetryBudget,
) -> bool:
    """Whether a request whose last copy came to ``result`` may go once more to another
    replica (spending a token of ``budget`` when it may)."""
    if retried:
        return False
    # A connect that failed sent nothing: safe for any request. A connection lost mid-way
    # or a 429 is retried only for idempotent requests.
    safe = isinstance(result, ConnectFailed) or idempotent
    if not safe or (isinstance(result, UpstreamError) and is_timeout(result)):
        return False
    if remaining_s <= 0:
        return False
    return budget.try_spend()
