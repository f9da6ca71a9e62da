"""The router's policies: which replica of a model's pool takes a request (affinity, power of
two choices, round-robin), when to hedge it and how many copies the budgets allow, and which
replicas are out (readiness checks, outlier ejection). Pure: no I/O, the time is passed in;
the proxy drives them."""

from __future__ import annotations

from tailserve.router.backends import Backend, Pool
from tailserve.router.balancing import (
    Balancer,
    BoundedLoadHash,
    PowerOfTwo,
    RoundRobin,
    make_balancer,
)
from tailserve.router.health import ActiveHealth, Ejection, OutlierDetector
from tailserve.router.hedging import HedgeBudget, HedgePolicy, RetryBudget, TokenBudget

__all__ = [
    "ActiveHealth",
    "Backend",
    "Balancer",
    "BoundedLoadHash",
    "Ejection",
    "HedgeBudget",
    "HedgePolicy",
    "OutlierDetector",
    "Pool",
    "PowerOfTwo",
    "RetryBudget",
    "RoundRobin",
    "TokenBudget",
    "make_balancer",
]
