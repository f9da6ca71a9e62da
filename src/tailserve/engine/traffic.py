"""The requests a worker's protocol adapters hold and have finished: what the event loop's
backlog (observability.loop_lag), and so admission, reads.

One count for HTTP and gRPC alike: a request is an inference the loop decodes, batches, answers
and encodes, whichever protocol brought it. A refusal answered at once is counted apart (it
costs the loop a fraction of a request).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Counts(Protocol):
    @property
    def in_flight(self) -> int: ...

    @property
    def answered(self) -> int: ...

    @property
    def refused(self) -> int: ...


@dataclass(slots=True)
class Traffic:
    """An adapter's own count (the HTTP server keeps the same three numbers)."""

    in_flight: int = 0
    answered: int = 0
    refused: int = 0


def total(sources: Iterable[Counts]) -> tuple[int, int, int]:
    """(in flight, answered, refused), over every adapter."""
    in_flight = answered = refused = 0
    for source in sources:
        in_flight += source.in_flight
        answered += source.answered
        refused += source.refused
    return in_flight, answered, refused
