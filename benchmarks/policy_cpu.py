"""What each batching policy costs the worker a request, side by side in one run.

On churn the event loop, not the model, is the bottleneck (HTTP, decoding, each batch's
dispatch and answers), so the worker's CPU time a request sets its capacity. Workers with the
deadline batcher and with size-or-timeout at 2 ms (``--policies`` for others) serve the same
fixed rate in alternation (``--rounds`` each, a fresh worker each round, no result cache): the
worker's CPU time per request (both threads), the mean batch, the client's p50 / p99 and the
goodput. docs/decisions/0003-deadline-batcher.md has what it showed.

    python benchmarks/policy_cpu.py [--model churn|sentiment] [--rate 4000] [--duration 6]
                                    [--rounds 2] [--policies deadline,size-or-timeout-2ms]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import _harness as h
from batching_policies import POLICIES
from inline_batches import MODELS, alternate, table


def main() -> None:
    parser = h.rounds_parser(
        __doc__,
        list(MODELS),
        "policy_cpu",
        duration=6.0,
        rate_help="default: churn 4,000, sentiment 2,000",
    )
    parser.add_argument(
        "--policies", default="deadline,size-or-timeout-2ms", help=f"of {', '.join(POLICIES)}"
    )
    parser.set_defaults(rounds=2)
    args = h.rounds_args(parser, {"churn": 4000.0, "sentiment": 2000.0})
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples = h.examples(work / "examples")
        repos = {
            name: h.one_model(examples / args.model, work / name, POLICIES[name], cache={})
            for name in policies
        }
        rows = alternate(repos, args)
    print(
        f"\n{args.model}, {args.rate:,.0f} req/s offered, {args.duration:g} s a round; "
        f"medians of {args.rounds} rounds"
    )
    medians = table(rows)
    first = medians[policies[0]]
    for name in policies[1:]:
        print(
            f"CPU a request, {policies[0]} / {name}: "
            f"{first['cpu_us'] / medians[name]['cpu_us']:.2f}x"
        )
    if any(r["behind"] for results in rows.values() for r in results):
        print("(the load generator fell behind in a round: rerun before reading the figures)")


if __name__ == "__main__":
    main()
