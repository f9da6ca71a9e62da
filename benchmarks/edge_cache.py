"""The client's edge cache side by side with the plain client, on a Zipf key stream.

One worker (``churn`` with its result cache on, L1 + a private Redis) and one `Client` in this
process, sending ``--requests`` requests from ``--concurrency`` tasks in a closed loop. Keys:
Zipf(``--s``) over ``--keys`` customers. The same stream goes through twice after a warm-up
pass that fills the worker's L1 (so both runs meet a warm worker): once with the plain client,
once with ``edge_cache=EdgeCache(ttl_s, max_entries)`` and the worker's Redis to follow
invalidations. Latency is measured in this process (``infer`` called to answered), which is
what the edge changes: the caller's process.

    python benchmarks/edge_cache.py [--requests 20000] [--keys 10000] [--s 1.0]
        [--concurrency 8] [--ttl-s 1.0] [--edge-entries 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

import _harness as h
from tailserve.client import Client, EdgeCache
from tailserve.examples.churn import FIELDS, as_inputs, draw_customers

Inputs = dict[str, np.ndarray[Any, Any]]


def customers(count: int) -> list[Inputs]:
    columns = as_inputs(draw_customers(np.random.default_rng(7), count))
    return [{f.name: columns[f.name][i : i + 1] for f in FIELDS} for i in range(count)]


def zipf_stream(keys: int, s: float, count: int, seed: int = 11) -> list[int]:
    weights = np.arange(1, keys + 1, dtype=float) ** -s
    drawn = np.random.default_rng(seed).choice(keys, size=count, p=weights / weights.sum())
    return [int(k) for k in drawn]


def worker_requests(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("tailserve_requests_total{") and 'model="churn"' in line
    )


async def run(client: Client, rows: list[Inputs], stream: list[int], concurrency: int) -> Any:
    latencies = np.empty(len(stream))
    sources: dict[str | None, int] = {}
    position = 0

    async def sender() -> None:
        nonlocal position
        while position < len(stream):
            index, position = position, position + 1
            started = time.perf_counter()
            result = await client.infer("churn", rows[stream[index]])
            latencies[index] = time.perf_counter() - started
            sources[result.edge] = sources.get(result.edge, 0) + 1

    began = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return latencies, sources, time.perf_counter() - began


async def measure(args: argparse.Namespace, url: str, redis_url: str) -> None:
    rows = customers(args.keys)
    stream = zipf_stream(args.keys, args.s, args.requests)
    async with Client([url]) as client:  # warm-up: the worker's L1 holds what the runs ask
        await run(client, rows, stream, args.concurrency)
    edge = EdgeCache(ttl_s=args.ttl_s, max_entries=args.edge_entries, redis_url=redis_url)
    print(
        f"churn, Zipf({args.s}) over {args.keys:,} keys, {args.requests:,} requests, "
        f"{args.concurrency} in flight; edge: TTL {args.ttl_s} s, {args.edge_entries:,} entries"
    )
    print(
        "| client | edge hits | to the worker | req/s | p50 ms | p99 ms | p99.9 ms |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    for name, config in (("plain", None), ("edge cache", edge)):
        async with Client([url], edge_cache=config) as client:
            before = worker_requests(url)
            latencies, sources, elapsed = await run(client, rows, stream, args.concurrency)
            sent = worker_requests(url) - before
        hits = sources.get("hit", 0) + sources.get("coalesced", 0)
        p50, p99, p999 = np.percentile(latencies, [50, 99, 99.9]) * 1e3
        share = "-" if config is None else f"{hits / len(stream):.1%}"
        print(
            f"| {name} | {share} | {sent:,} | {len(stream) / elapsed:,.0f} "
            f"| {p50:.3f} | {p99:.3f} | {p999:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--s", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--ttl-s", type=float, default=1.0)
    parser.add_argument("--edge-entries", type=int, default=1_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = h.examples(work / "examples") / "churn"
        repository = h.one_model(source, work / "repository")
        with h.redis(work) as redis_url:
            port = h.free_port()
            flags = ("--redis-url", redis_url, "--grpc-port", "0")
            with h.serving(h.worker(repository, port, *flags), port) as url:
                asyncio.run(measure(args, url, redis_url))


if __name__ == "__main__":
    main()
