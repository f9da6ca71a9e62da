"""What the fuzz tests share: how many examples a run tries (the quick profile in `make test`,
the long one with TAILSERVE_FUZZ=long, `make fuzz`), and the tally of what they tried."""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, settings

LONG = os.environ.get("TAILSERVE_FUZZ", "") == "long"

# The example models the fuzz worker serves (tests/fuzz/conftest.py).
FUZZ_MODELS = ("churn", "rerank", "sentiment")
ADMIN_TOKEN = "fuzz-admin-token"
# A request that takes longer than this hangs, as far as the fuzz tests are concerned.
TIMEOUT_S = 5.0

# Cases per operation (schemathesis) or per property (hypothesis).
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)
settings.register_profile(
    "long",
    # TAILSERVE_FUZZ_EXAMPLES (make fuzz FUZZ_EXAMPLES=N): 500 runs in about 10 minutes here.
    max_examples=int(os.environ.get("TAILSERVE_FUZZ_EXAMPLES", "500")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)
PROFILE = settings.get_profile("long" if LONG else "ci")

# Cases tried, by target ("openapi GET /v2/jobs", "codec from_binary"...), and failures seen.
CASES: Counter[str] = Counter()
FAILURES: Counter[str] = Counter()


def summary() -> str:
    targets = len(CASES)
    total = sum(CASES.values())
    failed = sum(FAILURES.values())
    profile = "long" if LONG else "ci"
    return f"fuzz ({profile}): {targets} targets, {total} cases, {failed} failing cases"
