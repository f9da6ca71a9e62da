"""tailserve side by side with what users would pick instead, on the same model and load.

Every target serves the churn pipeline of `tailserve examples --sklearn` (scaled numbers,
one-hot categories, a small MLP; `model.joblib`), each in its framework's own way, and is sent
the same unique churn rows (OIP v2 JSON bodies) by the same open-loop C generator, wrk2:

- tailserve: one worker (`tailserve serve`), the pipeline by its sklearn runtime
  (`churn_sklearn`) and the same pipeline exported to ONNX (`churn`), batching on;
- the stack (`stack`): `tailserve up` on `churn_sklearn` alone as `make run` starts it, one
  worker a core behind HAProxy, every request through the front door;
- LitServe (pinned below): a `LitAPI` over the pipeline, with LitServe's batching (16 rows, 2
  ms) and without;
- MLServer (pinned below): a custom `MLModel` over the pipeline (the V2 protocol is its own),
  with its adaptive batching (16 rows, 2 ms) and without;
- Ray Serve (pinned below): a deployment taking the Starlette request, one replica a core (a
  CPU each, as Serve reserves them; its proxy, GCS and raylet share those cores, as HAProxy
  shares tailserve's), in a Ray of its own; with `@serve.batch` (16 rows, 2 ms) and without;
- BentoML (pinned below): a `@bentoml.service` of one `@bentoml.api` taking the body, one worker
  a core; batched as its docs batch a request of several fields, through a batchable API of a
  second service (one worker a core too; 16 rows, its window adaptive), and without;
- FastAPI + uvicorn: the baseline most teams write first, each request scored alone.

Each peer is installed into a virtual environment of its own under ``--cache`` (default
``~/.cache/tailserve-peers``) on first use, its versions pinned, scikit-learn, numpy and
joblib at this environment's versions (a pickle wants the version that wrote it). A peer that
will not install is reported and left out. Each target runs in a session of its own and is
stopped with everything it started (Ray's and BentoML's workers are in groups or sessions of
their own: what is left of its process tree is killed).

Per target, in one run: cold start (process start to its first answer) and resident memory
(the process and every process below it); SLO capacity (wrk2, p99 <= 50 ms, no error, 64
connections); p50 / p99 / p99.9 and the CPU a request (the whole process tree) at ``--rate``
(20 req/s: a load every target carries); unless ``--quick``, goodput (200s within the SLO a
second) at 2x and 3x its own capacity over 1,000 connections, and the errors of the 5 s at
half its capacity after each.

    python benchmarks/peers.py [--quick]
        [--only tailserve,stack,litserve,mlserver,ray,bentoml,fastapi] [--cache DIR]
        [--step-s 5] [--rate 20] [--out DIR] [--replot PEERS_JSON ...]

`make compare` runs it with --quick. Writes DIR/peers.json and DIR/peers.png, and prints the
table (README.md, "Compared"). ``--replot`` draws the plot and prints the table again from
one run's peers.json, or from several (a target measured again in a later ``--only`` run
takes its earlier figures' place). Check with `ps` that nothing else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h
import _peer_apps as apps
import _wrk2

SLO_MS = 50.0


CHURN = "/v2/models/churn/infer"  # the route of every peer but LitServe


@dataclass
class Target:
    name: str
    url: str  # where wrk2 sends (the inference path is the script's)
    path: str
    start: Callable[[int], list[str]]  # the command for a port
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    results: dict[str, Any] = field(default_factory=dict)


# A peer's targets: from its environment's python, the folder of its files, their environment
# variables and the cores.
Build = Callable[[str, Path, dict[str, str], int], list[Target]]


@dataclass(frozen=True)
class Peer:
    """A framework installed in a virtual environment of its own."""

    name: str
    packages: tuple[str, ...]
    files: dict[str, str]
    build: Build

    def python(self, cache: Path) -> Path:
        return cache / f"venv-{self.name}" / "bin" / "python"


def batching(batch: int, how: str) -> str:
    return how if batch > 1 else "no batching"


def litserve(python: str, folder: Path, env: dict[str, str], cores: int) -> list[Target]:
    return [
        Target(
            f"LitServe, {batching(batch, 'batching 16 rows, 2 ms')}",
            "",
            "/predict",
            lambda port, b=batch: [python, "app.py", str(port), str(b)],
            env,
            folder,
        )
        for batch in (16, 1)
    ]


def mlserver(python: str, folder: Path, env: dict[str, str], cores: int) -> list[Target]:
    return [
        Target(
            f"MLServer, {batching(batch, 'adaptive batching 16 rows, 2 ms')}",
            "",
            CHURN,
            lambda port, b=batch: mlserver_command(python, port, b, folder),
            env,
            folder,
        )
        for batch in (16, 1)
    ]


def mlserver_command(python: str, port: int, batch: int, folder: Path) -> list[str]:
    """`mlserver start` on a folder of its settings: ``port`` for HTTP, free ones for gRPC and
    metrics, the model with adaptive batching up to ``batch`` rows (1: none)."""
    home = folder / f"serve-{batch}"
    home.mkdir(exist_ok=True)
    shutil.copy(folder / "app.py", home / "app.py")
    settings = {"http_port": port, "grpc_port": h.free_port(), "metrics_port": h.free_port()}
    (home / "settings.json").write_text(json.dumps(settings))
    model = {"name": "churn", "implementation": "app.ChurnModel"}
    if batch > 1:
        model.update(max_batch_size=batch, max_batch_time=0.002)
    (home / "model-settings.json").write_text(json.dumps(model))
    return [str(Path(python).parent / "mlserver"), "start", str(home)]


def ray(python: str, folder: Path, env: dict[str, str], cores: int) -> list[Target]:
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
    return [
        Target(
            f"Ray Serve, {cores} replicas, {batching(batch, '@serve.batch 16 rows, 2 ms')}",
            "",
            CHURN,
            lambda port, b=batch: [python, "app.py", str(port), str(b), str(cores)],
            env,
            folder,
        )
        for batch in (16, 1)
    ]


def bentoml(python: str, folder: Path, env: dict[str, str], cores: int) -> list[Target]:
    env = {
        **env,
        "WORKERS": str(cores),
        "BENTOML_HOME": str(folder / "home"),
        "BENTOML_DO_NOT_TRACK": "True",
    }
    serve = [str(Path(python).parent / "bentoml"), "serve", "--host", "127.0.0.1", "--port"]
    return [
        Target(
            f"BentoML, {cores} workers, {batching(batch, 'adaptive batching 16 rows')}",
            "",
            CHURN,
            lambda port, s=service: [*serve, str(port), s],
            env,
            folder,
        )
        for batch, service in ((16, "app:BatchedChurn"), (1, "app:Churn"))
    ]


def fastapi(python: str, folder: Path, env: dict[str, str], cores: int) -> list[Target]:
    uvicorn = [python, "-m", "uvicorn", "app:app", "--log-level", "warning", "--port"]
    return [Target("FastAPI + uvicorn", "", CHURN, lambda port: [*uvicorn, str(port)], env, folder)]


PEERS = {  # in the table's order
    "litserve": Peer("litserve", ("litserve==0.2.19",), {"app.py": apps.LITSERVE_APP}, litserve),
    # (uvloop 0.21 raises where MLServer 1.7.1's inference workers ask for an event loop)
    "mlserver": Peer(
        "mlserver", ("mlserver==1.7.1", "uvloop==0.19.0"), {"app.py": apps.MLSERVER_APP}, mlserver
    ),
    "ray": Peer("ray", ("ray[serve]==2.60.0",), {"app.py": apps.RAY_APP}, ray),
    # (from 1.4.30 the client of a dependent service fails requests in flight when it renews its
    # session, every 100 requests: bentoml/BentoML#5540, #5544)
    "bentoml": Peer("bentoml", ("bentoml==1.4.29",), {"app.py": apps.BENTOML_APP}, bentoml),
    "fastapi": Peer(
        "fastapi", ("fastapi==0.115.12", "uvicorn==0.34.0"), {"app.py": apps.FASTAPI_APP}, fastapi
    ),
}


def install(peer: Peer, cache: Path) -> str | None:
    """``peer``'s environment, made on first use and again when its pins change; why not, if it
    cannot be."""
    python = peer.python(cache)
    venv = python.parent.parent
    pins = [*peer.packages, *(f"{name}=={importlib.metadata.version(name)}" for name in _PINNED)]
    made = venv / "pins.txt"
    if made.exists() and made.read_text().split() == pins:
        return None
    shutil.rmtree(venv, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, **h.QUIET)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *pins],
            check=True,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(venv, ignore_errors=True)
        lines = (exc.stderr or "").strip().splitlines()
        return f"pip failed: {[e for e in lines if e.startswith('ERROR')][-1:] or lines[-1:]}"
    made.write_text("\n".join(pins))
    return None


_PINNED = ("scikit-learn", "numpy", "joblib")


def targets(args: argparse.Namespace, repository: Path) -> list[Target]:
    model = repository / "churn_sklearn" / "1" / "model.joblib"
    cores = len(os.sched_getaffinity(0))
    found: list[Target] = []
    wanted = set(args.only.split(","))
    if "tailserve" in wanted:
        for name in ("churn_sklearn", "churn"):
            folder = alone(args.cache, repository, name)
            found.append(
                Target(
                    f"tailserve ({'sklearn' if name == 'churn_sklearn' else 'ONNX'})",
                    "",
                    f"/v2/models/{name}/infer",
                    lambda port, f=folder: h.worker(f, port, "--grpc-port", "0"),
                )
            )
    if "stack" in wanted:  # (gRPC on as well, as `make run` starts it: a later flag wins)
        sklearn = alone(args.cache, repository, "churn_sklearn")
        found.append(
            Target(
                f"tailserve up (sklearn): HAProxy + {cores} workers",
                "",
                "/v2/models/churn_sklearn/infer",
                lambda port: h.up_command(sklearn, port, "--grpc-port", str(h.free_port())),
            )
        )
    for peer in (peer for name, peer in PEERS.items() if name in wanted):
        why = install(peer, args.cache)
        if why is not None:
            print(f"  {peer.name}: not installed ({why}); left out")
            continue
        folder = args.cache / f"app-{peer.name}"
        folder.mkdir(exist_ok=True)
        for filename, text in peer.files.items():
            (folder / filename).write_text(text)
        found += peer.build(str(peer.python(args.cache)), folder, {"MODEL": str(model)}, cores)
    return found


def alone(cache: Path, repository: Path, name: str) -> Path:
    """A repository of the one model, as each peer serves it (made on first use)."""
    folder = cache / f"only-{name}"
    if not folder.exists():
        shutil.copytree(repository / name, folder / name)
    return folder


# --- measuring ------------------------------------------------------------------------------


def body() -> bytes:
    row = {
        "tenure_months": ("INT64", 12),
        "monthly_spend": ("FP32", 80.5),
        "support_tickets": ("INT64", 2),
        "feature_usage_pct": ("FP32", 0.4),
        "last_login_days_ago": ("INT64", 3),
        "num_integrations": ("INT64", 5),
        "contract_type": ("BYTES", "annual"),
        "plan_tier": ("BYTES", "growth"),
        "is_enterprise": ("INT64", 0),
    }
    inputs = [{"name": n, "datatype": d, "shape": [1, 1], "data": [v]} for n, (d, v) in row.items()]
    return json.dumps({"inputs": inputs}).encode()


def answered(url: str) -> bool:
    request = urllib.request.Request(
        url, data=body(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running(target: Target) -> Iterator[tuple[int, float]]:
    """The target started; yields its pid and its cold start (seconds to a first answer)."""
    port = h.free_port()
    target.url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    process = subprocess.Popen(
        target.start(port),
        cwd=target.cwd,
        env={**os.environ, **target.env},
        start_new_session=True,
        **h.QUIET,
    )
    try:
        while not answered(target.url + target.path):
            if process.poll() is not None:
                raise RuntimeError(f"{target.name} exited with {process.returncode}")
            if time.monotonic() - began > 300:
                raise RuntimeError(f"{target.name} did not answer in 300 s")
            time.sleep(0.05)
        yield process.pid, time.monotonic() - began
    finally:
        h.stop_group(process, timeout=30)


def resident(root: int) -> int:
    total = 0
    for pid in h.process_tree(root):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf(
                "SC_PAGE_SIZE"
            )
    return total


def cpu(root: int) -> float:
    total = 0.0
    for pid in h.process_tree(root):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += h.cpu_seconds(pid)
    return total


def script(path: str) -> str:
    return _wrk2.SCRIPT.replace('local path = "/v2/models/churn/infer"', f'local path = "{path}"')


def measure(target: Target, args: argparse.Namespace) -> None:
    lua = script(target.path)
    with running(target) as (pid, cold_s):
        time.sleep(1.0)
        target.results.update(cold_start_s=cold_s, resident_bytes=resident(pid))
        before = cpu(pid)
        light = _wrk2.run(target.url, args.rate, args.step_s * 2, connections=8, script=lua)
        used = cpu(pid) - before
        target.results.update(
            p50_ms=light.quantile(0.5),
            p99_ms=light.quantile(0.99),
            p999_ms=light.quantile(0.999),
            light_errors=light.errors,
            cpu_us=used / max(1, light.total) * 1e6,
        )
        print(f"  {target.name}: capacity search")
        capacity = _wrk2.slo_capacity(target.url, args.step_s, SLO_MS, start_rps=200, script=lua)
        target.results["capacity_rps"] = capacity
        if args.quick or not capacity:
            return
        for factor in (2.0, 3.0):
            over = _wrk2.run(
                target.url, capacity * factor, args.step_s, connections=1000, script=lua
            )
            after = _wrk2.run(target.url, capacity / 2, 5, connections=64, script=lua)
            target.results[f"goodput_{factor:g}x"] = over.goodput(SLO_MS) / capacity
            target.results[f"after_{factor:g}x_errors"] = after.errors


def table(found: list[Target], quick: bool) -> str:
    columns = [
        ("SLO capacity, req/s", "capacity_rps", "{:,.0f}"),
        ("p50 / p99 / p99.9 ms", None, ""),
        ("CPU a request", "cpu_us", "{:,.0f} µs"),
        ("resident", "resident_bytes", ""),
        ("cold start", "cold_start_s", "{:.1f} s"),
    ]
    if not quick:
        columns += [
            ("goodput at 2x / 3x (over its capacity)", None, ""),
            ("errors 5 s after", None, ""),
        ]
    lines = ["| target | " + " | ".join(c[0] for c in columns) + " |"]
    lines.append("| --- |" + " ---: |" * len(columns))
    for target in found:
        r = target.results
        if "capacity_rps" not in r:
            lines.append(f"| {target.name} | " + " | ".join("-" for _ in columns) + " |")
            continue
        cells = []
        for title, key, form in columns:
            if title.startswith("p50"):
                cells.append(f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} / {r['p999_ms']:.1f}")
            elif key == "resident_bytes":
                cells.append(f"{r[key] / 2**20:,.0f} MiB")
            elif title.startswith("goodput"):
                cells.append(f"{r.get('goodput_2x', 0):.2f} / {r.get('goodput_3x', 0):.2f}")
            elif title.startswith("errors"):
                cells.append(f"{r.get('after_2x_errors', 0)} / {r.get('after_3x_errors', 0)}")
            elif key is not None:
                cells.append(form.format(r[key]))
        lines.append(f"| {target.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(found: list[Target], path: Path) -> None:
    """Two panels, a row a target: the SLO capacity, and the tails at the light rate (p50, p99,
    p99.9 on a log scale)."""
    pyplot = h.pyplot()
    if pyplot is None:
        return
    shown = [t for t in found if "capacity_rps" in t.results][::-1]
    names = [t.name for t in shown]
    figure, (capacity, tails) = pyplot.subplots(
        1, 2, figsize=(13, 0.55 * len(names) + 1.4), sharey=True
    )
    capacity.barh(names, [t.results["capacity_rps"] for t in shown], color="#4477aa")
    capacity.set_xlabel(f"SLO capacity, req/s (p99 <= {SLO_MS:.0f} ms, no error; wrk2)")
    rows = range(len(shown))
    for key, label, marker in (
        ("p50_ms", "p50", "o"),
        ("p99_ms", "p99", "s"),
        ("p999_ms", "p99.9", "^"),
    ):
        values = [t.results.get(key, float("nan")) for t in shown]
        tails.scatter(values, rows, label=label, marker=marker)
    tails.set_xscale("log")
    tails.set_xlabel("latency at 20 req/s, ms (log scale)")
    tails.legend(loc="lower right")
    figure.suptitle("The churn pipeline on 2 cores")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def replot(documents: list[Path], path: Path) -> str:
    """The plot and the table again from runs' peers.json files: a target measured again in
    a later run (``--only``) takes the place of its earlier figures, in the earlier order."""
    results: dict[str, dict[str, Any]] = {}
    for document in documents:
        results.update(json.loads(document.read_text()))
    found = [Target(name, "", "", lambda port: [], results=r) for name, r in results.items()]
    plot(found, path)
    quick = not any("goodput_2x" in r for r in results.values())
    return table(found, quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no overload runs")
    parser.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        help="only draw DIR/peers.png and print the table from these peers.json (later wins)",
    )
    parser.add_argument("--only", default=",".join(("tailserve", "stack", *PEERS)))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tailserve-peers")
    parser.add_argument("--step-s", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=20.0, help="req/s of the light load")
    parser.add_argument("--out", type=Path, default=h.HERE / "results" / "peers")
    args = parser.parse_args()
    if args.replot:
        args.out.mkdir(parents=True, exist_ok=True)
        print(replot(args.replot, args.out / "peers.png"))
        return
    _wrk2.binary()  # (says how to get it, if it is missing)
    args.cache.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    repository = args.cache / "examples"
    if not (repository / "churn_sklearn" / "model.yaml").exists():
        shutil.rmtree(repository, ignore_errors=True)
        h.examples(repository, "--sklearn")
    found = targets(args, repository)
    for target in found:
        print(f"{target.name}:")
        try:
            measure(target, args)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"  failed: {exc}")
    document = {t.name: t.results for t in found}
    (args.out / "peers.json").write_text(json.dumps(document, indent=2))
    plot(found, args.out / "peers.png")
    print()
    print(table(found, args.quick))


if __name__ == "__main__":
    main()
