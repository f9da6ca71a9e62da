"""The chaos suite: a real stack (`tailserve up`, two workers, Redis as its L2) under steady
open-loop load while workers are killed and stopped, Redis restarted and the front door killed;
prints the table (fault, requests sent, failed, lost, seconds to recover) and writes it to
``--out`` as chaos.json and chaos.md. `make chaos` runs it. The core is tests/support/chaos.py,
which the quick part in `make test` (tests/integration/test_chaos.py) shares."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.chaos import FAULTS, ChaosPlan, chaos_stack, churn_repository, run_chaos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    plan = ChaosPlan()
    parser.add_argument("--out", type=Path, default=Path("var/chaos"), help="(var/chaos)")
    parser.add_argument("--rate", type=float, default=plan.rate, help="requests a second")
    parser.add_argument("--kills", type=int, default=plan.kills, help="worker SIGKILLs")
    parser.add_argument("--quiet", type=float, default=plan.quiet_s, help="seconds after each")
    parser.add_argument(
        "--faults", default=",".join(plan.faults), help=f"some of {', '.join(FAULTS)}"
    )
    parser.add_argument("--seed", type=int, default=plan.seed)
    args = parser.parse_args()
    plan = ChaosPlan(
        rate=args.rate,
        kills=args.kills,
        quiet_s=args.quiet,
        faults=tuple(f for f in args.faults.split(",") if f),
        seed=args.seed,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        work = Path(tmp)
        from tailserve.examples import write_examples

        write_examples(work / "examples")
        repository = churn_repository(work / "examples", work / "repository")
        with chaos_stack(repository, work) as stack:
            try:
                result = asyncio.run(run_chaos(stack, plan))
            finally:
                (args.out / "up.log").write_bytes(stack.up.log_path.read_bytes())
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "python " + " ".join(sys.argv)
    table = result.table()
    print(table)
    (args.out / "chaos.json").write_bytes(
        orjson.dumps(
            {"when": when, "command": command, **result.as_dict()}, option=orjson.OPT_INDENT_2
        )
    )
    (args.out / "chaos.md").write_text(f"# Chaos, {when}\n\n`{command}`\n\n{table}\n")
    for row in result.rows:
        if row.why:
            print(f"{row.fault}: {row.why}")
    print(f"written to {args.out}/chaos.json and chaos.md")


if __name__ == "__main__":
    main()
