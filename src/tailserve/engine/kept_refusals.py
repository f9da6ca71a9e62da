"""Refusals kept for a moment: under overload, one refusal answers the like requests after it.

When a model is too busy for a request's deadline before the request is read (`DataPlane.
shed` raising a `DeadlineUnmeetable` that names a moment it stays true for), the requests of
the same kind (model, version and deadline header) that arrive within that moment with less
time left than the least it would have let through are refused with the same refusal, without
asking the scheduler again, and counted as the model's refusals. A burst against an
overloaded model costs a dictionary lookup a request.

Every protocol adapter screens its requests here (HTTP and gRPC alike); each may keep its own
rendering of a refusal on it (`Refusal.reply`), so a burst is answered with bytes made once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tailserve.errors import DeadlineUnmeetable

# (model, version, the deadline header's milliseconds or None)
Key = tuple[str, str | None, float | None]
# Kinds kept at most: the header is the client's to vary, so the memo is emptied when full.
MAX_KEPT = 256


class Shed(Protocol):
    def __call__(
        self, name: str, version: str | None, *, received_at: float, deadline_ms: float | None
    ) -> None: ...


@dataclass(slots=True)
class Refusal:
    """A refusal that answers the requests of its kind until ``until``."""

    error: DeadlineUnmeetable
    until: float  # monotonic clock
    least_s: float  # the least budget the model let through
    budget_s: float  # the budget the refused request had
    reply: Any = None  # an adapter's rendering of it, made once and kept here


class KeptRefusals:
    def __init__(
        self,
        shed: Shed,
        refused: Callable[[str, str | None], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._shed = shed
        self._refused = refused
        self._clock = clock
        self._kept: dict[Key, Refusal] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def screen(
        self, model: str, version: str | None, *, received_at: float, deadline_ms: float | None
    ) -> Refusal | None:
        """Refuse a request before it is read if its model is too busy for its deadline: a kept
        refusal of its kind, or a fresh one that is kept. None: the request goes on, screened.
        A refusal that holds for this request alone is raised."""
        key = (model, version, deadline_ms)
        kept = self._kept.get(key) if self._kept else None
        if kept is not None:
            now = self._clock()
            if now < kept.until:
                if received_at + kept.budget_s - now < kept.least_s:
                    self._refused(model, version)
                    return kept
            else:
                del self._kept[key]
        try:
            self._shed(model, version, received_at=received_at, deadline_ms=deadline_ms)
        except DeadlineUnmeetable as exc:
            if not exc.reusable_until:
                raise
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
            budget = exc.deadline - received_at
            refusal = Refusal(exc, exc.reusable_until, exc.least_budget_s, budget)
            self._kept[key] = refusal
            return refusal
        return None
