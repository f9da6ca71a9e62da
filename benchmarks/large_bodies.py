"""What a large request body costs the requests beside it, side by side in one run.

One worker (a one-line python model, ``y = 2x``) answers small inference requests sent one at
a time, 5 ms apart, for ``--duration`` seconds, in three configurations: alone; while another
client sends 40 MiB JSON bodies (one row padded with whitespace) back to back; and while it
sends the same bodies gzipped (40 KB each: a compression bomb within the 128 MiB limit). The
small requests' p50 / p99 / max and how many were answered, and each over "alone".

Bodies over 256 KiB and compressed ones are decompressed and decoded on a thread
(protocols/http/app.py, `_decode`), so the loop keeps answering while zlib inflates; the parse
of a large document by orjson is one C call and still holds the GIL throughout.

    python benchmarks/large_bodies.py [--duration 8] [--mib 40]
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import yaml

import _harness as h

MODEL = """
import numpy as np


class Model:
    def __init__(self, version_dir, config):
        pass

    def predict(self, inputs):
        return {"y": (inputs["x"] * 2).astype(np.float32)}
"""
CONFIG = {
    "runtime": "python",
    "max_batch_size": 64,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    "slo": {"p99_ms": 1000},
}
SMALL = orjson.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}
)
JSON = {"content-type": "application/json"}


def repository(directory: Path) -> Path:
    folder = directory / "double"
    (folder / "1").mkdir(parents=True)
    (folder / "model.yaml").write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    (folder / "1" / "model.py").write_text(MODEL)
    return directory


def run(url: str, big: tuple[bytes, dict[str, str]] | None, duration: float) -> list[float]:
    """The small requests' latencies (ms) while ``big`` (a body and its headers) is sent
    back to back by another client."""
    stop = threading.Event()

    def send_big() -> None:
        assert big is not None
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                reply = client.post(url, content=big[0], headers=big[1])
                assert reply.status_code == 200, reply.text

    sender = threading.Thread(target=send_big) if big else None
    latencies = []
    with httpx.Client(timeout=120) as client:
        for _ in range(50):
            client.post(url, content=SMALL, headers=JSON)
        if sender:
            sender.start()
        until = time.monotonic() + duration
        while time.monotonic() < until:
            start = time.perf_counter()
            reply = client.post(url, content=SMALL, headers=JSON)
            latencies.append((time.perf_counter() - start) * 1e3)
            assert reply.status_code == 200, reply.text
            time.sleep(0.005)
    stop.set()
    if sender:
        sender.join()
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--mib", type=int, default=40, help="the large body's size (40 MiB)")
    args = parser.parse_args()
    padded = SMALL[:-1] + b" " * (args.mib * 1024 * 1024) + b"}"
    zipped = gzip.compress(padded, 6)
    configs = {
        "alone": None,
        f"beside {args.mib} MiB JSON": (padded, JSON),
        f"beside {len(zipped) // 1024} KB gzip": (zipped, {**JSON, "content-encoding": "gzip"}),
    }
    work = Path(tempfile.mkdtemp(prefix="large-bodies-"))
    port = h.free_port()
    command = h.worker(
        repository(work), port, "--max-body-bytes", str(128 * 1024 * 1024), "--grpc-port", "0"
    )
    rows = {}
    with h.serving(command, port):
        url = f"http://127.0.0.1:{port}/v2/models/double/infer"
        for name, big in configs.items():
            latencies = run(url, big, args.duration)
            rows[name] = (
                len(latencies),
                latencies[len(latencies) // 2],
                latencies[int(len(latencies) * 0.99)],
                latencies[-1],
            )
            print(f"{name}: {rows[name][0]} small requests", flush=True)
    alone = rows["alone"]
    print(
        f"\n{'small requests':28} {'answered':>9} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}"
        f" {'p50 / alone':>12}"
    )
    for name, (count, p50, p99, worst) in rows.items():
        print(
            f"{name:28} {count:>9,} {p50:>9.2f} {p99:>9.2f} {worst:>9.1f} {p50 / alone[1]:>11.1f}x"
        )


if __name__ == "__main__":
    main()
