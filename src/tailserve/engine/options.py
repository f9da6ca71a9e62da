"""A request's options as the engine reads them: its deadline, priority and cache mode.

They come as OIP parameters (``timeout`` in µs, ``priority``, ``cache``) or from the transport
(`InferRequest.deadline_ms`, ``priority``, ``cache_mode``); a parameter wins, except that the
tighter of two deadlines does.
"""

from __future__ import annotations

import math
import time

from tailserve.cache.tiered import MODES, Mode
from tailserve.engine.messages import InferRequest
from tailserve.errors import InvalidInput, shown
from tailserve.modelconfig import ModelConfig

# The longest budget a request may have: a day is no deadline to speak of, and capped, the
# policy's arithmetic stays in range whatever a client sends.
MAX_BUDGET_S = 86_400.0


def deadline_and_priority(config: ModelConfig, request: InferRequest) -> tuple[float, bool, int]:
    """The absolute deadline (monotonic clock), whether the client set it, and the priority.

    The budget is the tighter of the ``timeout`` parameter and ``deadline_ms``, else the
    model's SLO; it counts from the request's arrival.
    """
    budgets = []
    timeout = request.parameters.get("timeout")
    if timeout is not None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise InvalidInput(
                f"parameter 'timeout' must be a positive number of µs, got {shown(timeout)}"
            )
        # (min first: an integer of hundreds of digits is no float.)
        budgets.append(min(timeout, MAX_BUDGET_S * 1e6) / 1e6)
    if request.deadline_ms is not None:
        budgets.append(request.deadline_ms / 1e3)
    budget = min(min(budgets) if budgets else config.slo.p99_ms / 1e3, MAX_BUDGET_S)
    received = request.received_at if request.received_at is not None else time.monotonic()
    levels = config.batching.priority_levels
    given = "priority" in request.parameters
    priority = request.parameters.get("priority", request.priority)
    hard = bool(budgets)
    if priority is None or priority == 0:  # 0: the default level, as in Triton
        return received + budget, hard, config.batching.default_priority
    if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= levels:
        where = "parameter 'priority'" if given else "X-Priority (the 'priority' option)"
        raise InvalidInput(
            f"{where} must be a whole number in 1..{levels} (1 is the highest; "
            f"0 or none: the default {config.batching.default_priority}), got {shown(priority)}"
        )
    return received + budget, hard, priority


def cache_mode(request: InferRequest) -> Mode:
    mode = request.parameters.get("cache", request.cache_mode)
    if mode is None:
        return "use"
    if mode not in MODES:
        where = "parameter 'cache'" if "cache" in request.parameters else "X-Cache-Mode"
        raise InvalidInput(f"{where} must be one of {', '.join(MODES)}, got {shown(mode)}")
    return mode  # type: ignore[no-any-return]
