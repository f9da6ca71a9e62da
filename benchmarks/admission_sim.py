"""Admission control in simulation: one churn-like worker on a fake clock, no server.

The worker (tests/support/admission_sim.py) runs the real `DeadlineBatcher` and `LoopLag` on a
simulated event loop: Poisson arrivals of one-row requests with a 50 ms SLO, 80-120 µs of the
loop a request (a refusal before reading ~25 µs, after decoding ~85 µs), batches of
0.2 ms + 0.5 µs a row on the loop's thread. Capacity is taken as 6,500 req/s, the figure
measured from outside for one churn worker (the simulated loop alone would serve ~9,000).

Scenarios (each as a cached model, as churn is, before and after docs/decisions/0002, and as a
model without a cache):

- fresh: 10 s at 0.6x capacity;
- overload: 10 s at 3x, then 10 s at 0.5x (refusals after the first 5 s must be 0);
- neighbours: 10 s at 0.6x with the loop's wall time per request doubled (the core taken in
  4 ms turns), then 10 s normal;
- search: a capacity search's steps beside the neighbours (3,600, 7,200, 4,800, 2,400 req/s),
  then 2,400 without them, with 1,000 client connections (wrk2's model).

Deterministic (one seed); a few seconds on one core.

    python benchmarks/admission_sim.py [--scenario NAME] [--shed none,loop,model] [--windows]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.admission_sim import Phase, Worker, report

CAPACITY = 6500.0
NEIGHBOURS = {"slowdown": 2.0, "slice_s": 0.004}

SCENARIOS: dict[str, tuple[list[Phase], int | None]] = {
    "fresh": ([Phase("fresh", 10, 0.6 * CAPACITY)], None),
    "overload": (
        [Phase("3x", 10, 3 * CAPACITY), Phase("after", 10, 0.5 * CAPACITY)],
        None,
    ),
    "neighbours": (
        [
            Phase("neighbours", 10, 0.6 * CAPACITY, **NEIGHBOURS),
            Phase("after", 10, 0.6 * CAPACITY),
        ],
        None,
    ),
    "search": (
        [
            Phase("3600 nb", 5, 3600, **NEIGHBOURS),
            Phase("7200 nb", 5, 7200, **NEIGHBOURS),
            Phase("4800 nb", 5, 4800, **NEIGHBOURS),
            Phase("2400 nb", 10, 2400, **NEIGHBOURS),
            Phase("2400", 5, 2400),
        ],
        1000,
    ),
}

SHEDS = {
    "none": "cached model, not shed before reading (before 0002)",
    "loop": "cached model, shed for the loop's backlog (0002)",
    "model": "model without a cache, shed for its queue and the loop's backlog",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default=",".join(SCENARIOS))
    parser.add_argument("--shed", default=",".join(SHEDS))
    parser.add_argument("--windows", action="store_true", help="the refusal share over time")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for name in args.scenario.split(","):
        phases, connections = SCENARIOS[name]
        for shed in args.shed.split(","):
            worker = Worker(seed=args.seed, shed=shed, connections=connections)
            result = worker.run(phases)
            lines = report(result)
            print(f"== {name}: {SHEDS[shed]}")
            print("\n".join(lines if args.windows else lines[: len(phases) + 1]))
            print()


if __name__ == "__main__":
    main()
