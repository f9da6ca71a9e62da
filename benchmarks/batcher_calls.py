"""What each batching policy's own calls cost a request, in-process, side by side in one run.

No server, no model: a fake clock drives one instance through churn-like traffic (Poisson
arrivals, one row each, batches costing 50 µs plus 4 µs a row, run on the loop's thread as
churn's are). Each request is shed before it is read and offered after, as the HTTP worker
does; every batch is polled, observed and its members completed. The time is that of the
batcher's calls alone (perf_counter around each), so it is the policy's bookkeeping, the part
of a request's CPU that differs between policies (the worker's whole CPU a request:
`policy_cpu.py`).

    python benchmarks/batcher_calls.py [--rate 7500] [--requests 200000] [--rounds 2]
                                       [--loop-busy 0.6]
"""

from __future__ import annotations

import argparse
import random
import time

from tailserve.engine.batching import Batcher, Item, SizeOrTimeout
from tailserve.engine.buckets import Bucket
from tailserve.engine.deadline_batcher import DeadlineBatcher

BUCKET = Bucket("all", "all")
SLO_S = 0.050


def batch_cost(rows: int) -> float:
    return 0.00005 + 0.000004 * rows


def make(policy: str) -> Batcher:
    if policy == "deadline":
        return DeadlineBatcher(max_rows=256, instances=1, max_queue=10_000)
    return SizeOrTimeout(max_rows=256, max_delay_s=0.002, max_queue=10_000)


class Simulation:
    """One instance, polled when it is free and an arrival asks for it (``poll_soon``), or when
    the time a poll gave comes; batches run at once for their cost."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.free = 0.0
        self.wake: float | None = None
        self.spent = 0.0
        self.batches = 0
        self.rows = 0

    def poll(self, now: float) -> None:
        started = time.perf_counter()
        poll = self.batcher.poll(now, [max(self.free, now)])
        self.spent += time.perf_counter() - started
        self.wake = poll.wait_until
        if not poll.batch:
            return
        rows = sum(item.rows for item in poll.batch)
        took = batch_cost(rows)
        self.free = now + took
        started = time.perf_counter()
        self.batcher.observe(BUCKET, rows, took, 0.0, self.free)
        for item in poll.batch:
            self.batcher.completed(item, self.free)
        self.spent += time.perf_counter() - started
        self.batches += 1
        self.rows += rows
        if len(self.batcher):
            self.wake = self.free

    def arrive(self, now: float) -> None:
        batcher = self.batcher
        free_at = [max(self.free, now)]
        started = time.perf_counter()
        batcher.shed(now, free_at, deadline=now + SLO_S, priority=1)
        batcher.offer(Item(1, BUCKET, now, now + SLO_S, 1, screened=True), now, free_at)
        soon = batcher.poll_soon
        self.spent += time.perf_counter() - started
        if (soon or self.wake is None) and self.free <= now:
            self.poll(now)

    def run(self, rate: float, requests: int, seed: int) -> None:
        rng = random.Random(seed)
        now = 0.0
        for _ in range(requests):
            now += rng.expovariate(rate)
            while self.wake is not None and self.wake <= now:
                due = max(self.wake, self.free)
                if due > now:
                    break
                self.poll(due)
            self.arrive(now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=7500.0)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--loop-busy",
        type=float,
        default=0.6,
        help="the event loop's busy share the batchers are told",
    )
    args = parser.parse_args()
    results: dict[str, list[float]] = {"deadline": [], "size-or-timeout-2ms": []}
    rows: dict[str, float] = {}
    for round_ in range(args.rounds):
        for policy in results:
            batcher = make(policy)
            batcher.loop_busy = args.loop_busy
            batcher.loop_delay_s = 0.0005
            batcher.loop_backlog_s = 0.001
            for size in (1, 64):  # the warm-up's seed of the cost model
                batcher.observe(BUCKET, size, batch_cost(size), -1.0)
            simulation = Simulation(batcher)
            simulation.run(args.rate, args.requests, seed=round_)
            results[policy].append(simulation.spent / args.requests * 1e6)
            rows[policy] = simulation.rows / max(simulation.batches, 1)
    base = min(results["size-or-timeout-2ms"])
    print(
        f"{args.rate:,.0f} req/s, {args.requests:,} requests a round, loop busy "
        f"{args.loop_busy:.0%}; the batcher's calls, µs a request (each round), best over "
        "size-or-timeout's best"
    )
    for policy, times in results.items():
        rounds = ", ".join(f"{t:.2f}" for t in times)
        print(
            f"{policy:<22}{rounds:>20}   {min(times) / base:5.2f}x   "
            f"rows a batch {rows[policy]:.1f}"
        )


if __name__ == "__main__":
    main()
