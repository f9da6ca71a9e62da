"""Render tailserve's Kubernetes objects from deploy/values.yaml (and overrides) as YAML.

    python deploy/render.py | kubectl apply -f -
    python deploy/render.py --values prod.yaml --set autoscaling.maxReplicas=32
    python deploy/render.py --output-dir deploy/rendered     # a file an object

It imports tailserve (the front door's config is `tailserve up`'s own): run it with the
project's environment (`.venv/bin/python`, or after `pip install -e .`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Run as a script, this folder is on sys.path and holds the `kube` package.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml
from kube import Obj, ValuesError, load, render


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (configs, scripts) as literal blocks, readable in the output."""


def _str(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects: Sequence[Obj]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--values",
        "-f",
        type=Path,
        action="append",
        default=[],
        help="a YAML file merged over deploy/values.yaml (repeatable, later wins)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="one value, e.g. autoscaling.maxReplicas=32 (a YAML scalar; repeatable)",
    )
    parser.add_argument("--output-dir", type=Path, help="write a file an object here instead")
    args = parser.parse_args(argv)
    try:
        objects = render(load(args.values, args.set))
    except ValuesError as exc:
        print(f"render.py: error: {exc}", file=sys.stderr)
        return 2
    if args.output_dir is None:
        sys.stdout.write(dump(objects))
        return 0
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for index, obj in enumerate(objects):
        kind, name = obj["kind"].lower(), obj["metadata"]["name"]
        (args.output_dir / f"{index:02d}-{kind}-{name}.yaml").write_text(dump([obj]))
    print(f"wrote {len(objects)} objects to {args.output_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
